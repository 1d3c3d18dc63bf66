"""A real-size V4-Flash slice in flashserve and in llama.cpp: decode tokens/s on the same prompts, in turn.

    python -m flashserve.bench.slice --model deepseek-v4-flash --layers 2 --out SLICE
    python -m flashserve.bench.llamacpp convert SLICE SLICE.gguf      # llama.cpp's converter: MXFP4 experts, Q8_0 dense
    python scripts/bench_slice_llamacpp.py SLICE SLICE.gguf [--batches 1 16] [--repeats 3] [--new 16] [--threads 2]
                                           [--quantizations stored w4a8]

Each repeat runs, one after the other, a fresh flashserve process (``scripts/bench_slice.py``, the engine's default
compiled step, the checkpoint mapped) and a fresh llama.cpp process (llama-cpp-python with its defaults:
the file mapped, F16 KV cache, flash attention auto) on the prompts ``bench_slice.py`` makes (32 tokens each), and
reports the medians and their ratio; each engine's files are made resident right before its run (the other's
dropped from the page cache: both do not fit beside flashserve's memory here). The converter's GGUF is what a
llama.cpp user of the released checkpoint runs: it keeps the MXFP4 experts, turns the block-FP8 dense weights
into Q8_0 and keeps the bf16 head and embeddings.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORED = "stored"  # the slice's weights as stored, exact


def warm(paths: list[Path], others: list[Path]) -> None:
    """Drop ``others`` from the page cache and read ``paths`` through it. On this machine the slice, the GGUF and
    flashserve's own memory do not all fit at once, and pages the other engine touched last stay cached before
    pages read once: each engine's files are made resident right before its run (the bar is resident decode)."""
    import os

    for path in others:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def flashserve_rate(slice_dir: Path, gguf: Path, batch: int, new: int, threads: int, quantization: str) -> float:
    warm(sorted(slice_dir.glob("*.safetensors")), [gguf])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_slice.py"), str(slice_dir), "--batches",
                        str(batch), "--repeats", "1", "--new", str(new), "--threads", str(threads), "--json",
                        str(out), *([] if quantization == STORED else ["--quantization", quantization])],
                       check=True, capture_output=True, text=True)
        return json.loads(out.read_text())["rows"][0]["tok_s"]


def llamacpp_rate(gguf: Path, slice_dir: Path, prompts: list[list[int]], new: int, threads: int) -> float:
    warm([gguf], sorted(slice_dir.glob("*.safetensors")))
    run = subprocess.run([sys.executable, "-m", "flashserve.bench.llamacpp", "decode", str(gguf), "--prompts",
                          json.dumps(prompts), "--new", str(new), "--threads", str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(run.stdout.strip().splitlines()[-1])["decode_tok_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slice", type=Path)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantizations", nargs="+", default=[STORED], choices=(STORED, "w4a8"),
                    help="flashserve runs per repeat: the slice as stored (exact) and/or --quantization w4a8 (its "
                         "experts times activations rounded to 8 bits, as llama.cpp multiplies them)")
    args = ap.parse_args(argv)
    from flashserve.bench.workload import prompts

    for b in args.batches:
        batch = [list(p) for p in prompts(b, 32, 40 + b)]  # bench_slice.py's prompts for this batch size
        fs: dict[str, list[float]] = {q: [] for q in args.quantizations}
        lc = []
        for r in range(args.repeats):
            for q in args.quantizations:
                fs[q].append(flashserve_rate(args.slice, args.gguf, b, args.new, args.threads, q))
            lc.append(llamacpp_rate(args.gguf, args.slice, batch, args.new, args.threads))
            ours = ", ".join(f"flashserve ({q}) {v[-1]:7.2f} tok/s" for q, v in fs.items())
            print(f"batch {b:>2} repeat {r}: {ours}, llama.cpp {lc[-1]:7.2f} tok/s", flush=True)
        m = statistics.median(lc)
        for q, v in fs.items():
            f = statistics.median(v)
            print(f"batch {b:>2}: flashserve ({q}) {f:.2f} tok/s, llama.cpp {m:.2f} tok/s (medians of "
                  f"{args.repeats}): {f / m:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
