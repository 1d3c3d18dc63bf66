"""One MoE layer's routed experts at V4.1-Flash's size (MXFP4, 2304 x 5120), stacked against held one matrix an
expert (flashserve/model/mapped_experts.py), in one process, alternating, the same routing for both.

    python scripts/bench_mapped_experts.py [--experts 64] [--rows 1 16] [--repeats 7] [--threads 2]

Prints the median milliseconds of a layer's routed experts each way and their ratio, and checks the outputs equal
to the bit. Random bytes and routing (top-6). Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashserve.model.mapped_experts import NAMES, MappedExperts
from flashserve.model.packed import EXPERT_FP4, PackedExperts


def random_mxfp4_experts(E: int, D: int, I: int, g: torch.Generator) -> PackedExperts:
    """``E`` MXFP4 experts of V4.1-Flash's shape with random codes and scales near 2^-7 (bench_moe_threads too)."""
    experts = PackedExperts(E, D, I, 10.0, EXPERT_FP4)
    for n in NAMES:
        p = getattr(experts, f"{n}_packed")
        p.qweight.copy_(torch.randint(0, 256, p.qweight.shape, generator=g, dtype=torch.uint8))
        p.scale.copy_(torch.randint(118, 122, p.scale.shape, generator=g, dtype=torch.uint8))
    return experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    E, D, I, k = args.experts, 5120, 2304, 6
    g = torch.Generator().manual_seed(0)
    stacked = random_mxfp4_experts(E, D, I, g)
    mapped = MappedExperts(stacked)
    for n in NAMES:
        p = getattr(stacked, f"{n}_packed")
        for e in range(E):
            mapped.hold(e, n, p.qweight[e], p.scale[e])
    for rows in args.rows:
        x = torch.randn(rows, D, generator=g)
        times: dict[str, list[float]] = {"stacked": [], "mapped": []}
        for _ in range(args.repeats):
            idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])
            w = torch.rand(rows, k, generator=g)
            out = {}
            for name, layer in (("stacked", stacked), ("mapped", mapped)):
                t = time.perf_counter()
                out[name] = layer(x, idx, w)
                times[name].append(time.perf_counter() - t)
            assert torch.equal(out["stacked"], out["mapped"])
        med = {n: statistics.median(v[1:]) * 1e3 for n, v in times.items()}  # the first call warms up
        print(f"{rows:>2} rows, {E} experts: stacked {med['stacked']:.2f} ms, mapped {med['mapped']:.2f} ms "
              f"({med['mapped'] / med['stacked']:.2f}x the time), outputs equal")


if __name__ == "__main__":
    main()
