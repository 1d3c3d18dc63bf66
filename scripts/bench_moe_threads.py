"""Thread scaling of the MoE kernels at V4.1-Flash's size: one layer's routed experts (MXFP4, 2304 x 5120, top-6)
through the engine's decode path (cpu_kernels' MXFP4 gate/up and down kernels) at 1..N threads, against a plain read
of memory at the same thread count.

    python scripts/bench_moe_threads.py [--experts 64] [--rows 1 16] [--threads 1 2] [--repeats 9]

For each thread count and row count: the median milliseconds of a layer's routed experts, the bytes of the experts
the call touched (each routed expert's three matrices and scales once), those bytes over the time (GB/s), and that
rate as a fraction of a plain float32 sum's read bandwidth with the same threads. Random bytes and routing, the
experts picked afresh each call from ``--experts`` (so few repeat at one row). Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_mapped_experts import random_mxfp4_experts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashserve.model import cpu_kernels  # noqa: E402
from flashserve.model.packed import EXPERT_FP4, PackedExperts  # noqa: E402
from scripts.bench_slice import read_bandwidth  # noqa: E402

NAMES = ("w1", "w2", "w3")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    assert cpu_kernels.build() is not None, "the CPU kernels could not be built here"
    E, D, I, k = args.experts, 5120, 2304, 6
    g = torch.Generator().manual_seed(0)
    experts = random_mxfp4_experts(E, D, I, g)
    per_expert = sum(getattr(experts, f"{n}_packed").qweight[0].numel() + getattr(experts, f"{n}_packed").scale[0]
                     .numel() for n in NAMES)
    print(f"{E} experts of {per_expert / 1e6:.1f} MB (MXFP4 with scales), top-{k}, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    base: dict[int, float] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = read_bandwidth(1 << 30, args.repeats)
        for rows in args.rows:
            x = torch.randn(rows, D, generator=g)
            times, touched = [], []
            with torch.inference_mode():
                for _ in range(args.repeats + 1):
                    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])
                    w = torch.rand(rows, k, generator=g)
                    t = time.perf_counter()
                    experts(x, idx, w)
                    times.append(time.perf_counter() - t)
                    touched.append(len(idx.unique()) * per_expert)
            ms = statistics.median(times[1:]) * 1e3  # the first call warms up
            rate = statistics.median(b / t for b, t in zip(touched[1:], times[1:]))
            base.setdefault(rows, ms)
            print(f"{threads} thread(s), {rows:>2} rows: {ms:7.2f} ms ({base[rows] / ms:.2f}x the speed at "
                  f"{args.threads[0]}), "
                  f"{rate / 1e9:5.1f} GB/s of experts read against {bandwidth / 1e9:5.1f} GB/s plain read "
                  f"({rate / bandwidth:.2f}x)")


if __name__ == "__main__":
    main()
