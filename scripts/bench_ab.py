"""Decode speed of two source trees of flashserve on the peers checkpoint, in one run, against llama.cpp.

    python scripts/bench_ab.py BEFORE_TREE AFTER_TREE [--repeats 3] [--threads 2] [--new 128]

Each tree runs in a child process of its own (``PYTHONPATH=tree``), on the same checkpoint (the engine
benchmark's peers V4, written once), eager and compiled, at batch 1 and 16, decode-only tokens/s; llama.cpp
(llama-cpp-python, F32 GGUF, F32 KV, flash-attention off) decodes the same prompts in between as the anchor. The
trees alternate within each repeat, so both see the same machine; the figures are medians and the ratios are
of medians. A change that should not move speed shows ratios of about 1.0 between the trees. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, torch
from flashserve.model.loader import load_model
from flashserve.bench.workload import engine_for, fs_run, prompts
folder, new, eager = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "eager"
torch.set_num_threads(int(sys.argv[4]))
model = load_model(folder, dtype=torch.float32, fake_quant=False, with_mtp=False)
engine = engine_for(model, folder, max_num_seqs=16, enforce_eager=eager, threads=int(sys.argv[4]))
out = {}
for b in (1, 16):
    batch = prompts(b, 128, 40 + b)
    fs_run(engine, batch[:2], 2)
    _, dec = fs_run(engine, batch, new)
    out[b] = b * (new - 1) / dec
print("RESULT " + json.dumps(out))
"""


def child(tree: Path, folder: Path, new: int, mode: str, threads: int) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(new), mode, str(threads)], env=env,
                          capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {int(k): v for k, v in json.loads(line[7:]).items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=128, help="tokens decoded per request and run")
    args = ap.parse_args(argv)
    import torch

    from flashserve.bench import llamacpp
    from flashserve.bench.engine import build_hf_v4
    from flashserve.bench.workload import prompts
    from flashserve.model.loader import load_model

    runs: dict[tuple[str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "peers"
        build_hf_v4(folder, "peers")
        model = load_model(folder, dtype=torch.float32, fake_quant=False, with_mtp=False)
        peer = None if llamacpp.unavailable() else llamacpp.Peer(model, Path(tmp), args.threads)
        for r in range(args.repeats):
            for mode in ("eager", "compiled"):
                for name, tree in (("before", args.before), ("after", args.after)):
                    for b, rate in child(tree, folder, args.new, mode, args.threads).items():
                        runs.setdefault((name, mode, b), []).append(rate)
                        print(f"repeat {r}: {name} {mode} batch {b}: {rate:.1f} tok/s", flush=True)
            if peer is not None:
                for b in (1, 16):
                    rate = peer.decode_rate("f32", prompts(b, 128, 40 + b), args.new, "f32", "off")
                    runs.setdefault(("llama.cpp", "f32", b), []).append(rate)
                    print(f"repeat {r}: llama.cpp F32 batch {b}: {rate:.1f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\nmedians of {args.repeats}, {args.threads} threads, {args.new} new tokens, decode-only tok/s")
    for mode in ("eager", "compiled"):
        for b in (1, 16):
            before, after = med[("before", mode, b)], med[("after", mode, b)]
            line = f"{mode:>8} batch {b:>2}: before {before:7.1f}  after {after:7.1f}  after/before {after / before:.3f}"
            anchor = med.get(("llama.cpp", "f32", b))
            if anchor:
                line += f"   vs llama.cpp F32 {anchor:7.1f}: before {before / anchor:.3f}x, after {after / anchor:.3f}x"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
