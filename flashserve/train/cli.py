"""``flashserve train``: the recipe of the embedded default model (see docs/training.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def _fields():
    from .settings import Recipe

    return [f for f in dataclasses.fields(Recipe)]


def register(sub) -> None:
    from .settings import STAGES, Recipe

    p = sub.add_parser("train", help="train the default model (tokenizer, V4.1 backbone, DSpark drafter) on "
                                     "the Python standard library, on the CPU",
                       description="Train the embedded default model's recipe on the CPU: a byte-level BPE "
                                   "tokenizer, a V4.1 backbone and its DSpark drafter, exported with a held-out "
                                   "report (see docs/training.md).")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma-separated stages to run, in order (default: all: {','.join(STAGES)})")
    p.add_argument("--fast", action="store_true", help="a few steps on a few files at a tiny width (seconds)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to WORK/log.jsonl)")
    defaults = Recipe()
    for f in _fields():
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        kind = Path if f.name in ("out", "work") else (int if f.name == "file_limit" else type(value))
        p.add_argument(flag, type=kind, default=None, help=f"(default: {value})")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from .recipe import Recipe, run

    given = {f.name: getattr(args, f.name) for f in _fields() if getattr(args, f.name) is not None}
    if args.fast:
        work = given.pop("work", Path("runs/fast"))
        out = given.pop("out", Path("runs/fast/model"))
        recipe = Recipe.fast(work, out, **given)
    else:
        recipe = Recipe(**given)
    results = run(recipe, [s for s in args.stages.split(",") if s], progress=not args.no_progress)
    summary = {k: {a: b for a, b in v.items() if a not in ("losses", "recipe")} for k, v in results.items()}
    print(json.dumps(summary, indent=2))
    return 0


def _standalone(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashserve.train")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
