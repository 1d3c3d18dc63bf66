"""`flashserve plan` against the engine's real-size slice runs on this machine: calibrate on one run, predict the rest.

    python scripts/plan_slices.py machine --out THIS.json [--threads 2] [--slice DIR]
    python scripts/plan_slices.py check --machine THIS.json FIT_RUN.json [RUN.json ...]

``machine`` measures this machine as the planner describes one without a GPU (docs/plan.md section 2): host
memory and its read bandwidth (a float32 sum over 1 GiB, as ``bench_slice.py``'s bound), the CPU's float32
FLOP/s (torch's 2048^3 product), the engine's MXFP4 expert kernels' read rate at one row (V4.1-Flash's experts,
2304 x 5120, top-6 of 64, each used where it lies as a mapped slice's are), and with ``--slice`` the disk's
sequential read of that slice's files, page cache dropped. Each value's source names the command.

``check`` reads ``bench_slice.py --json`` runs (one slice each, with or without ``--weight-memory``; the planner's
stored runs were eager, ``bench_slice.py --enforce-eager``, the step it was fitted on),
plans each measured batch size on the machine file (the slice's config, experts MXFP4, dense FP8, its bf16 head,
the run's prompt and output lengths; a budget run's experts held per layer resident and the rest on disk, at the
cache hit rate the run measured and the disk bandwidth it measured), fits eta_mem and eta_flop on the points of
the first run given, and prints every point's predicted and measured tokens/s per agent. Not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def matmul_gflops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times) / 1e9


def expert_kernel_gbs(threads: int, repeats: int = 9, n_experts: int = 64) -> float:
    """GB/s of MXFP4 experts the engine's mapped expert path reads at one row (median over calls, experts picked
    afresh each call)."""
    import torch
    from bench_mapped_experts import random_mxfp4_experts

    from flashserve.model import cpu_kernels
    from flashserve.model.mapped_experts import MappedExperts

    if cpu_kernels.build() is None:
        raise SystemExit("the CPU kernels could not be built here: no expert kernel rate to measure")
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    stacked = random_mxfp4_experts(n_experts, 5120, 2304, g)
    mapped = MappedExperts(stacked)
    per_expert = 0
    for n in ("w1", "w2", "w3"):
        p = getattr(stacked, f"{n}_packed")
        for e in range(n_experts):
            mapped.hold(e, n, p.qweight[e], p.scale[e])
        per_expert += p.qweight[0].numel() + p.scale[0].numel()
    x = torch.randn(1, 5120, generator=g)
    rates = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            idx = torch.randperm(n_experts, generator=g)[:6].view(1, 6)
            w = torch.rand(1, 6, generator=g)
            t = time.perf_counter()
            mapped(x, idx, w)
            if i:  # the first call warms up
                rates.append(6 * per_expert / (time.perf_counter() - t))
    return statistics.median(rates) / 1e9


def measure_machine(args: argparse.Namespace) -> int:
    from bench_slice import disk_read_bandwidth, read_bandwidth

    cmd = "scripts/plan_slices.py machine" + (f" --slice {args.slice}" if args.slice else "")
    mem_gib = int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal"))
                  .split()[1]) / 2**20
    import torch

    torch.set_num_threads(args.threads)
    bw = read_bandwidth(1 << 30, 7) / 1e9
    flops = matmul_gflops(args.threads)
    experts = expert_kernel_gbs(args.threads)
    host = {"cpu": cpu_name(),
            "memory_gib": {"value": round(mem_gib, 1), "source": "/proc/meminfo MemTotal"},
            "bandwidth_gbs": {"value": round(bw, 2), "source": f"measured by {cmd}: a float32 sum over 1 GiB, "
                                                                f"{args.threads} threads (median of 7)"},
            "cpu_cores": {"value": args.threads, "source": "the threads the engine runs with"},
            "expert_tflops": {"value": round(flops / 1e3, 4), "source": f"measured by {cmd}: torch's float32 "
                                                                         f"2048^3 product, {args.threads} threads"},
            "expert_gbs": {"value": round(experts, 2), "source": f"measured by {cmd}: the engine's mapped MXFP4 "
                           f"expert kernels at one row, V4.1-Flash's 2304 x 5120 experts, top-6 of 64, "
                           f"{args.threads} threads (median of 9 calls)"}}
    out = {"name": "this-machine", "description": f"this machine ({host['cpu']}), measured, no GPU",
           "efficiency": "cpu-local", "host": host}
    if args.slice:
        disk = disk_read_bandwidth(Path(args.slice)) / 1e9
        out["disk"] = {"read_gbs": {"value": round(disk, 2), "source": f"measured by {cmd}: a sequential read "
                                                                       "of the slice's files, page cache dropped"}}
    else:
        out["not_published"] = {"disk.read_gbs": "not measured: pass --slice DIR"}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


def check(args: argparse.Namespace) -> int:
    from flashserve.plan.engine_runs import FIT_TERMS, check_runs, run_points

    runs = [(Path(p).name, run_points(json.loads(Path(p).read_text()), args.machine)) for p in args.runs]
    fitted, rows = check_runs(runs, args.machine)
    print(f"fitted on {runs[0][0]} ({len(runs[0][1])} points): " + ", ".join(f"{k} {v:.3f}" for k, v in fitted.items()))
    print(f"{'run':<28} {'batch':>5} {'role':>8} {'measured':>9} {'predicted':>9} {'error':>7}")
    for r in rows:
        print(f"{r.run:<28} {r.batch:>5} {'fit' if r.fitted else 'held out':>8} {r.measured:9.2f} {r.predicted:9.2f} "
              f"{100 * r.error:+6.0f}%")
    held = [abs(r.error) for r in rows if not r.fitted]
    print(f"largest held-out error {100 * max(held, default=0):.0f}% (decode tokens/s of the whole batch; fitted: "
          f"{', '.join(FIT_TERMS)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("machine", help="measure this machine into a machine file")
    m.add_argument("--out", required=True)
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--slice", default=None, help="a slice folder whose files time the disk")
    c = sub.add_parser("check", help="fit on the first run, predict the others")
    c.add_argument("--machine", required=True)
    c.add_argument("runs", nargs="+", help="bench_slice.py --json files; the first is fitted")
    args = ap.parse_args(argv)
    return measure_machine(args) if args.what == "machine" else check(args)


if __name__ == "__main__":
    sys.exit(main())
