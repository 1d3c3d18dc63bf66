"""``flashserve generate [MODEL] "prompt"``: stream a completion and a tokens/s progress line (no MODEL: the
embedded default, see :mod:`flashserve.models`)."""

from __future__ import annotations

import argparse
import sys
import time

from ..cli_help import HelpFormatter
from ..errors import UserError
from ..engine.options import add_engine_args, engine_config

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C'd command


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate a completion for one prompt",
                              formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="preset name (tiny-v4, tiny-v41), checkpoint folder or DeepSeek-V4 GGUF file (default: the "
                        "embedded model, a small V4.1 trained on the Python standard library)")
    p.add_argument("prompt")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    s.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--top-k", type=int, default=0, help="0: off")
    s.add_argument("--min-p", type=float, default=0.0, help="0: off")
    s.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine start-up (cache sizes)")
    add_engine_args(p)
    p.set_defaults(func=run_generate)
    return p


def run_generate(args: argparse.Namespace) -> int:
    """Ctrl-C ends the line and exits 130 without a traceback (the request is aborted by ``LLM.stream``)."""
    try:
        return _generate(args)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED


def _generate(args: argparse.Namespace) -> int:
    import logging

    from ..engine import preflight
    from ..engine.sampling_params import SamplingParams

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    from ..models import resolve_model

    args.model = resolve_model(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.request_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos, output_kind="delta")
    if not args.prompt:
        raise UserError("prompt: empty prompt")
    config = engine_config(args)
    params.validate(preflight.check(config).model_config.vocab_size)  # every flag, before loading
    from ..interrupts import deferred_interrupt

    with deferred_interrupt():
        from .llm import LLM  # torch: only once every flag is known to be good

    t0 = time.perf_counter()
    llm = LLM.from_config(config)
    load = time.perf_counter() - t0
    t1 = time.perf_counter()
    first = None
    n = 0
    reason = None
    for out in llm.stream(args.prompt, params):
        c = out.outputs[0]
        if first is None:
            first = time.perf_counter() - t1
        n += len(c.token_ids)
        sys.stdout.write(c.text)
        sys.stdout.flush()
        reason = c.finish_reason
    el = time.perf_counter() - t1
    sys.stdout.write("\n")
    sys.stdout.flush()
    decode_rate = (n - 1) / (el - first) if n > 1 and el > first else 0.0
    sys.stderr.write(f"{n} tokens in {el:.2f}s: {n / el:.1f} tok/s overall, {decode_rate:.1f} tok/s decode, "
                     f"first token {first * 1000:.0f} ms, load {load:.1f}s, finish={reason}\n")
    return 0
