"""Decode speed on a real-size slice (python -m flashserve.bench.slice) against this machine's memory-read bound.

    python scripts/bench_slice.py SLICE_DIR [--threads 2] [--new 16] [--batches 1 16] [--repeats 3]
                                  [--no-enforce-eager]

Loads the slice as the engine does (its FP8 and MXFP4 weights kept packed), and reports per batch size: decode-only
tokens/s (medians of ``--repeats``), the bytes a decode step reads (every dense weight once, the routed experts
the batch's tokens pick in expectation, one embedding row a token), and the bound those bytes allow at the
memory-read bandwidth measured in the same run by a plain pass over a buffer of as many bytes. Also the load
time and the resident bytes by part. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of a plain pass (a float32 sum) over a buffer of ``nbytes``, in this process's threads."""
    import torch

    buf = torch.ones(max(nbytes // 4, 1 << 20), dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(max(repeats, 3)):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.numel() * 4 / statistics.median(times)


def step_bytes(model, batch: int) -> tuple[int, dict[str, int]]:
    """Bytes one decode step of ``batch`` tokens reads, by part: dense tensors whole, each layer's routed experts
    by the expected number a batch picks (uniform routing: E (1 - (1 - k/E)^batch)), ``batch`` embedding rows."""
    from flashserve.model.moe import Experts

    cfg = model.cfg
    parts: dict[str, int] = {}
    expert_modules = {name for name, m in model.named_modules() if isinstance(m, Experts)}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        nbytes = t.numel() * t.element_size()
        if any(name.startswith(e + ".") for e in expert_modules):
            E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            picked = E * (1 - (1 - k / E) ** batch)
            part, nbytes = "routed experts", int(nbytes * picked / E)
        elif name.startswith("embed."):
            part, nbytes = "embedding rows", nbytes * batch // t.shape[0]
        elif ".engram.embed." in name:
            part = "engram rows"
            nbytes = nbytes * batch * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads // t.shape[0]
        elif name.startswith(("rope.", "engram_hasher.")):
            continue
        else:
            part = "head" if name.startswith("head.") else "dense"
        parts[part] = parts.get(part, 0) + nbytes
    return sum(parts.values()), parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slice", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=16, help="tokens decoded per request and run")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    from flashserve.bench.workload import engine_for, fs_run, prompts
    from flashserve.model import packed
    from flashserve.model.loader import load_model

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = load_model(args.slice, with_mtp=False)
    load_s = time.perf_counter() - t0
    resident = packed.resident_bytes(model)
    print(f"{args.slice}: loaded in {load_s:.1f} s, {resident / 2**30:.2f} GiB resident; "
          f"{args.threads} threads, decode {'eager' if args.enforce_eager else 'compiled'}")
    engine = engine_for(model, str(args.slice), max_num_seqs=max(args.batches), enforce_eager=args.enforce_eager,
                        threads=args.threads, speculative_config="off", max_model_len=4096)
    rows = []
    for b in args.batches:
        batch = prompts(b, 32, 40 + b)
        fs_run(engine, batch[:1], 2)
        rates = []
        for _ in range(args.repeats):
            _, dec = fs_run(engine, batch, args.new)
            rates.append(b * (args.new - 1) / dec)
        rate = statistics.median(rates)
        nbytes, parts = step_bytes(model, b)
        bandwidth = read_bandwidth(nbytes, args.repeats)
        bound = b * bandwidth / nbytes  # tokens/s if a step cost only reading its bytes once
        rows.append({"batch": b, "tok_s": rate, "step_bytes": nbytes, "parts": parts,
                     "read_GB_s": bandwidth / 1e9, "bound_tok_s": bound, "of_bound": rate / bound})
        shares = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        print(f"batch {b:>2}: {rate:8.2f} tok/s; a step reads {nbytes / 2**30:.2f} GiB ({shares}); plain read "
              f"{bandwidth / 1e9:.1f} GB/s -> bound {bound:.2f} tok/s; {rate / bound:.2f}x the bound")
    if args.json:
        args.json.write_text(json.dumps({"slice": str(args.slice), "load_s": load_s, "resident": resident,
                                         "threads": args.threads, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
