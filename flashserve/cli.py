"""The ``flashserve`` command: ``info``, ``generate``, ``serve``, ``plan``, ``bench``, ``train`` (each part registers
its own)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .cli_help import HelpFormatter
from .config.checkpoint_layout import QUANTIZATIONS
from .errors import UserError

DESCRIPTION = "Run, serve, benchmark and plan DeepSeek-V4 and V4.1 models (and a small embedded demo model)."
EPILOG = "Run 'flashserve COMMAND --help' for a command's flags and their defaults."


def _info(args: argparse.Namespace) -> int:
    from .config import load_config, model_arithmetic

    cfg = load_config(args.model)  # a ConfigError is the user's: one line, "flashserve info: error: ..."
    if args.memory or args.tensor_parallel_size != 1 or args.enable_expert_parallel or args.data_parallel_size != 1:
        return _info_memory(args)
    a = model_arithmetic(cfg)
    data = {
        "model": args.model,
        "model_type": cfg.model_type,
        "params_total": a.params_total,
        "params_all": a.params_all,
        "params_active_prefill": a.params_active_prefill,
        "params_active_decode": a.params_active_decode,
        "kv_bytes_per_token": a.kv_bytes_per_token,
        "window_bytes_per_sequence": a.window_bytes_per_sequence,
        "kv_record_bytes": {"main": a.kv.main, "index": a.kv.index, "window": a.kv.window},
        "params_by_part": a.by_part,
        "layer_roles": [cfg.layer_role(i) for i in range(cfg.num_hidden_layers)],
    }
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.model} ({cfg.model_type})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key in ("params_total", "params_all", "params_active_prefill", "params_active_decode"):
        table.add_row(key, _params(data[key]))
    table.add_row("kv_bytes_per_token", f"{a.kv_bytes_per_token:,.2f} bytes")
    table.add_row("window_bytes_per_sequence", f"{a.window_bytes_per_sequence / 2**20:,.2f} MiB")
    for part, n in sorted(a.by_part.items(), key=lambda kv: -kv[1]):
        table.add_row(f"  {part}", _params(n))
    console = Console()
    console.print(table)
    console.print("params_total: the backbone, every part but the engram tables, the drafter (MTP/DSpark) and the "
                  "vision tower; params_all: those too, everything the checkpoint stores. params_active_*: used "
                  "per prompt token (prefill) and per generated token (decode). kv_bytes_per_token: KV cache per "
                  "token of context; window_bytes_per_sequence: sliding-window state per sequence, whatever "
                  "its length.", highlight=False)
    return 0


def _params(n: float) -> str:
    """A parameter count in words: ``551.881 billion params``, ``13.388 million params``, ``960 params``."""
    for scale, word in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million")):
        if n >= scale:
            return f"{n / scale:,.3f} {word} params"
    return f"{int(n):,} params"


def _info_memory(args: argparse.Namespace) -> int:
    """``info MODEL --memory [--tensor-parallel-size N --enable-expert-parallel --data-parallel-size M]``."""
    from .config.ranks import Layout
    from .parallel.memory import rank_memory

    layout = Layout.from_options(args.tensor_parallel_size, args.enable_expert_parallel, args.data_parallel_size)
    m = rank_memory(args.model, layout, dtype=args.dtype, quantization=args.quantization,
                    cache_dtype=args.cache_dtype, block_size=args.block_size,
                    speculative_config=args.speculative_config)
    data = {"model": args.model, **m.as_dict()}
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    gib = 2 ** 30
    print(f"{args.model}: {m.layout}, weights {m.weight_format}; per rank:")
    r = m.resident_weight_bytes
    print(f"  resident weights   {r:>20,} B  ({r / gib:,.2f} GiB)  (backbone + vision tower"
          f"{' + drafter' if m.drafter_loaded else ''})")
    print(f"  backbone weights   {m.weight_bytes:>20,} B  ({m.weight_bytes / gib:,.2f} GiB)  (what `plan` models)")
    print(f"    routed experts   {m.routed_expert_bytes:>20,} B")
    print(f"    split (1/TP)     {m.split_dense_bytes:>20,} B  (heads, output groups, shared expert, vocabulary)")
    print(f"    replicated       {m.replicated_dense_bytes:>20,} B  (mHC, router, norms, compressors, indexer, ...)")
    if m.vision_bytes:
        print(f"  vision tower       {m.vision_bytes:>20,} B  (replicated on every rank; always loaded)")
    if m.drafter_bytes:
        how = ("loaded: --speculative-config" if m.drafter_loaded
               else "NOT counted above; loaded with --speculative-config method mtp or dspark")
        print(f"  drafter (MTP)      {m.drafter_bytes:>20,} B  (replicated on every rank; {how})")
        if not m.drafter_loaded:
            w = r + m.drafter_bytes
            print(f"  resident + drafter {w:>20,} B  ({w / gib:,.2f} GiB)")
    print(f"  kv cache / token   {m.kv_bytes_per_token:>20,.2f} B  (replicated on {m.kv_replicas} TP rank(s))")
    print(f"  bounded / sequence {m.bounded_bytes_per_sequence:>20,} B  (window rings, compressor groups, look-back)")
    print(f"  host (per node)    {m.host_table_bytes:>20,} B  (engram tables, memory-mapped, not per rank)")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashserve", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="parameter and KV-cache arithmetic of a preset or checkpoint",
                          description="Parameter counts and KV-cache bytes of a preset or checkpoint (--memory: "
                                      "per-rank resident bytes of a layout).", formatter_class=HelpFormatter)
    info.add_argument("model", help="preset name, checkpoint folder or DeepSeek-V4 GGUF file")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("--memory", action="store_true",
                      help="per-rank resident bytes of the layout (weights, cache per token, bounded state)")
    info.add_argument("--tensor-parallel-size", type=int, default=1, help="TP ranks (with --memory)")
    info.add_argument("--enable-expert-parallel", action="store_true", help="experts partitioned over the ranks")
    info.add_argument("--data-parallel-size", type=int, default=1, help="attention data-parallel ranks")
    info.add_argument("--dtype", default="bfloat16", help="compute dtype of float weights (with --memory)")
    info.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                      help="weight format (default: the release's, mxfp4, for real-dimension presets; float for "
                           "the tiny ones; a checkpoint as stored)")
    info.add_argument("--cache-dtype", default=None, choices=("packed", "float"), help="KV cache layout")
    info.add_argument("--block-size", type=int, default=64, help="tokens per KV page")
    info.add_argument("--speculative-config", default=None,
                      help="as serve's (JSON); method mtp or dspark counts the drafter stack each rank loads")
    info.set_defaults(func=_info)
    from .bench import cli as bench_cli
    from .entrypoints import generate as generate_cli
    from .plan import cli as plan_cli
    from .server import cli as server_cli
    from .train import cli as train_cli

    for mod in (generate_cli, server_cli, plan_cli, bench_cli, train_cli):
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, OSError) as exc:  # the user's input, not a bug
        print(f"flashserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback, the shell's 130
        print(f"flashserve {args.command}: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The process's entry (``flashserve``, ``python -m flashserve``): :func:`main`, then the exit. Two exits end
    the process at once, output flushed, with the command's status instead of the interpreter's teardown:
    - a decode step still compiling in the background is inside dynamo or a compiler, and ending the interpreter
      under it crashed (SIGSEGV, seen after Ctrl-C);
    - after Ctrl-C (130): the interrupt may have landed in the middle of one of torch's imports (made lazily
      while the engine is built), and the interpreter's teardown of those half-made modules ended the process by
      SIGINT (status -2, seen under load) instead of with 130."""
    import logging
    import os
    import threading

    code = main()
    if code == 130 or any(t.name == "flashserve-compile" and t.is_alive() for t in threading.enumerate()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
