"""Decode speed on a real-size slice (python -m flashserve.bench.slice) against this machine's memory-read bound.

    python scripts/bench_slice.py SLICE_DIR [--threads 2] [--new 16] [--batches 1 16] [--repeats 3]
                                  [--enforce-eager] [--quantization w4a8]

Loads the slice as the engine does (its FP8 and MXFP4 weights kept packed), and reports per batch size: decode-only
tokens/s (medians of ``--repeats``), the bytes a decode step reads (every dense weight once, the routed experts
the batch's tokens pick in expectation, one embedding row a token), and the bound those bytes allow at the
memory-read bandwidth measured in the same run by a plain pass over a buffer of as many bytes. Also the load
time and the resident bytes by part. The engine tokenizes with the slice's ``tokenizer.json``; a slice folder
without one gets the synthetic tokenizer ``flashserve.bench.slice`` writes (the engram layers need its classes),
built from the slice's config in a temporary folder. ``--json`` writes the run (each batch size's tokens/s and
expert-cache hit rate, the experts held per layer and the disk's bandwidth under ``--weight-memory``) in the form
``scripts/plan_slices.py check`` plans. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
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


def disk_read_bandwidth(folder: Path, limit: int = 2 << 30) -> float:
    """Bytes/s of a sequential read of up to ``limit`` bytes of ``folder``'s safetensors files, their pages first
    dropped from the page cache (``posix_fadvise(DONTNEED)``, which a clean file's pages obey without privileges)."""
    import os

    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    done, t = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as handle:
            while done < limit and (chunk := handle.read(16 << 20)):
                done += len(chunk)
        if done >= limit:
            break
    return done / (time.perf_counter() - t)


def step_bytes(model, batch: int) -> tuple[int, dict[str, int]]:
    """Bytes one decode step of ``batch`` tokens reads, by part: dense tensors whole (a weight with bfloat16
    panels, or block-FP8 codes in panels, by its panels), each layer's routed experts by the expected number a
    batch picks (uniform routing: E (1 - (1 - k/E)^batch)), ``batch`` embedding rows."""
    import torch

    from flashserve.model.moe import Experts

    cfg = model.cfg
    parts: dict[str, int] = {}
    expert_modules = {name for name, m in model.named_modules() if isinstance(m, Experts)}
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in [n for n in tensors if n.endswith("_panels") and tensors[n].dtype == torch.bfloat16]:
        tensors.pop(name.removesuffix("_panels"), None)  # decode rows read a bf16 weight's panels, not the weight
    for name in [n for n in tensors if n.endswith(".fp8_panels")]:  # and a block-FP8 layer's panels, not its codes
        tensors.pop(name.removesuffix("fp8_panels") + "packed.qweight", None)
    for name, t in tensors.items():
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
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    for m in model.modules():  # experts used where they lie (mapped_experts.MappedExperts): matrices, not buffers
        for held in getattr(m, "matrices", {}).values():
            nbytes = sum(q.numel() + s.numel() for q, s in held)
            parts["routed experts"] = parts.get("routed experts", 0) + int(nbytes * (1 - (1 - k / E) ** batch))
    return sum(parts.values()), parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slice", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=16, help="tokens decoded per request and run")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                    help="decode eagerly (default: the engine's, a compiled step)")
    ap.add_argument("--weight-memory", default=None,
                    help="resident budget for the weights (e.g. 6GiB): the routed experts beyond it are streamed")
    ap.add_argument("--expert-cache-policy", default="lru", choices=("lru", "lfu"))
    ap.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=True,
                    help="map the files (large MXFP4 experts used where they lie); --no-mmap copies (stacked experts)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quantization", default=None, choices=("w4a8",),
                    help="w4a8: the MXFP4 experts times activations rounded to 8 bits (default: as stored, exact)")
    args = ap.parse_args(argv)
    import torch

    from flashserve.bench.workload import engine_for, fs_run, prompts
    from flashserve.model import packed
    from flashserve.engine.preflight import parse_size
    from flashserve.model.expert_cache import cache_stats, expert_caches
    from flashserve.model.loader import load_model

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    budget = None if args.weight_memory is None else parse_size(args.weight_memory)
    model = load_model(args.slice, with_mtp=False, weight_memory=budget, expert_cache_policy=args.expert_cache_policy,
                       mmap=args.mmap, quantization=args.quantization)
    load_s = time.perf_counter() - t0
    resident = packed.resident_bytes(model)
    disk = slots = None
    if budget is not None:
        disk = disk_read_bandwidth(args.slice)
        slots = cache_stats(expert_caches(model))["slots"]
        print(f"weight memory {budget / 2**30:.2f} GiB ({args.expert_cache_policy}): "
              f"{cache_stats(expert_caches(model))['slots']} experts a layer held; the slice's files read at "
              f"{disk / 1e9:.2f} GB/s sequentially from the disk (page cache dropped)")
    print(model.load_report.describe())
    tokenizer_dir = None
    if not (args.slice / "tokenizer.json").exists():  # a folder without one: the slice's synthetic tokenizer
        from flashserve.bench.slice import write_tokenizer

        tokenizer_dir = tempfile.TemporaryDirectory(prefix="slice-tokenizer-")
        write_tokenizer(Path(tokenizer_dir.name), model.cfg)
        print(f"{args.slice} has no tokenizer.json: serving through the synthetic one flashserve.bench.slice writes")
    engine = engine_for(model, str(args.slice), max_num_seqs=max(args.batches), enforce_eager=args.enforce_eager,
                        threads=args.threads, speculative_config="off", max_model_len=4096,
                        tokenizer=None if tokenizer_dir is None else tokenizer_dir.name)
    print(f"{args.slice}: loaded in {load_s:.1f} s, {resident / 2**30:.2f} GiB resident; "
          f"{args.threads} threads, decode {'compiled' if engine.plan.compiled else 'eager'}"
          f"{', experts w4a8' if args.quantization else ''}")
    rows = []
    for b in args.batches:
        batch = prompts(b, 32, 40 + b)
        fs_run(engine, batch[:1], 2)
        rates = []
        before = cache_stats(expert_caches(model))
        for _ in range(args.repeats):
            _, dec = fs_run(engine, batch, args.new)
            rates.append(b * (args.new - 1) / dec)
        rate = statistics.median(rates)
        after = cache_stats(expert_caches(model))
        hit_rate = None
        if after is not None:
            d = {k: after[k] - before[k] for k in ("hits", "misses", "bytes_read", "read_ahead", "read_ahead_used")}
            hit_rate = d["hits"] / max(d["hits"] + d["misses"], 1)
            tokens = args.repeats * b * args.new  # decoded tokens (the prompts' prefill steps read experts too)
            print(f"batch {b:>2}: expert cache hit rate {100 * d['hits'] / max(d['hits'] + d['misses'], 1):.1f}%, "
                  f"{d['bytes_read'] / tokens / 1e6:.1f} MB read from the files a token (prefill included); "
                  f"read ahead {d['read_ahead']} experts (the next layer's router on this layer's input), "
                  f"{d['read_ahead_used']} of them then chosen")
        nbytes, parts = step_bytes(model, b)
        bandwidth = read_bandwidth(nbytes, args.repeats)
        bound = b * bandwidth / nbytes  # tokens/s if a step cost only reading its bytes once
        if after is not None and disk:
            # under a budget: a step reads what it misses from the disk, the rest from memory; a decode step's
            # misses are a run's reads less its prompts' (one more run of one token each, counted alone)
            start = cache_stats(expert_caches(model))["bytes_read"]
            fs_run(engine, batch, 1)
            prompt_bytes = cache_stats(expert_caches(model))["bytes_read"] - start
            decode_bytes = max(d["bytes_read"] / args.repeats - prompt_bytes, 0)
            missed = min(decode_bytes / max(args.new - 1, 1), nbytes)
            print(f"batch {b:>2}: a run's prompts read {prompt_bytes / 1e6:.1f} MB of experts, its {args.new - 1} "
                  f"decode steps {decode_bytes / 1e6:.1f} MB")
            bound = b / ((nbytes - missed) / bandwidth + missed / disk)
            print(f"batch {b:>2}: runs {', '.join(f'{r:.2f}' for r in rates)} tok/s (the first one after the "
                  f"page cache was dropped); a step misses {missed / 1e6:.1f} MB: bound {bound:.2f} tok/s at "
                  f"{bandwidth / 1e9:.1f} GB/s from memory and {disk / 1e9:.2f} GB/s from the disk")
        rows.append({"batch": b, "tok_s": rate, "expert_hit_rate": hit_rate, "step_bytes": nbytes, "parts": parts,
                     "read_GB_s": bandwidth / 1e9, "bound_tok_s": bound, "of_bound": rate / bound})
        shares = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        print(f"batch {b:>2}: {rate:8.2f} tok/s; a step reads {nbytes / 2**30:.2f} GiB ({shares}); plain read "
              f"{bandwidth / 1e9:.1f} GB/s -> bound {bound:.2f} tok/s; {rate / bound:.2f}x the bound")
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    kib = {k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    print(f"process resident at the end {kib['VmRSS'] / 2**30:.2f} GiB ({kib['RssAnon'] / 2**30:.2f} anonymous, "
          f"{kib['RssFile'] / 2**30:.2f} file pages), peak {kib['VmHWM'] / 2**30:.2f} GiB")
    if args.json:
        args.json.write_text(json.dumps({
            "slice": str(args.slice), "load_s": load_s, "resident": resident, "threads": args.threads,
            "enforce_eager": not engine.plan.compiled, "mmap": args.mmap, "weight_memory": budget,
            "quantization": args.quantization,
            "expert_cache_policy": args.expert_cache_policy if budget is not None else None,
            "experts_held_per_layer": slots, "disk_read_GB_s": None if disk is None else disk / 1e9,
            "prompt_len": 32, "new_tokens": args.new, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
