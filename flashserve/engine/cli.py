"""``flashserve generate MODEL "prompt"``: stream a completion and a tokens/s progress line."""

from __future__ import annotations

import argparse
import sys
import time


def add_threads_arg(g) -> None:
    """``--threads N``: torch's intra-op threads (``generate`` and ``serve``); the engine validates N."""
    from .threads import DEFAULT_THREADS

    g.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help=f"torch intra-op threads (default {DEFAULT_THREADS}: suits a shared machine, see "
                        "docs/engine-speed.md)")


def add_compile_arg(g) -> None:
    """``--enforce-eager`` / ``--no-enforce-eager``: run the decode step eagerly, or compile it."""
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="decode eagerly (--enforce-eager) or through a torch.compile'd fixed-shape step "
                        "(--no-enforce-eager); default: compiled on CUDA, eager on the CPU, where the first "
                        "compile takes minutes (see docs/engine-speed.md)")


def add_quantization_arg(g) -> None:
    """``--quantization int8|fp8|mxfp4|float``: weights packed in memory (default: as the checkpoint stores them)."""
    g.add_argument("--quantization", choices=("int8", "fp8", "mxfp4", "float"), default=None,
                   help="pack float weights at load (int8 per row, fp8 blocks, mxfp4 experts) or unpack a "
                        "packed checkpoint (float); default: weights as the checkpoint stores them")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    g.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda")
    g.add_argument("--kv-memory", default="1GiB", help="memory for the global KV pages, e.g. 1GiB")
    g.add_argument("--cache-dtype", choices=["packed", "float"], default=None,
                   help="packed (V4.1 default) or float (V4 default)")
    g.add_argument("--exact-prefill", action="store_true", help="run every layer on every prompt row (V4.1)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--block-size", type=int, default=64)
    g.add_argument("--prefix-replay", choices=["exact", "window"], default="exact",
                   help="after a prefix-cache hit, rebuild window state exactly (default) or by one window")
    g.add_argument("--seed", type=int, default=0, help="engine seed (unseeded requests)")
    add_threads_arg(g)
    add_compile_arg(g)
    add_quantization_arg(g)


def engine_options(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, kv_memory=args.kv_memory, cache_dtype=args.cache_dtype,
                exact_prefill=args.exact_prefill, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                enable_prefix_caching=not args.no_prefix_caching, block_size=args.block_size, seed=args.seed,
                prefix_replay=args.prefix_replay, threads=args.threads, enforce_eager=args.enforce_eager,
                quantization=args.quantization)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("model", help="preset name (tiny-v4, tiny-v41) or checkpoint folder")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine start-up (cache sizes)")
    add_engine_args(p)
    p.set_defaults(func=run_generate)
    return p


def run_generate(args: argparse.Namespace) -> int:
    import logging

    from .llm import LLM
    from .sampling_params import SamplingParams

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_options(args))
    load = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.request_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos, output_kind="delta")
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

