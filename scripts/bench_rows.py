"""One engram table of V4.1-Flash's row width read through the row cache (flashserve/model/row_cache.py) against
the same table mapped whole, under Zipfian row ids.

    python scripts/bench_rows.py [--rows 4000000] [--tokens 20000] [--zipf 1.0] [--fractions 0.01 0.05 0.2]

Writes a table of ``--rows`` rows (256 FP8 bytes and 8 scale bytes a row, as V4.1-Flash's) to a temporary
safetensors file, then decodes ``--tokens`` tokens of 24 lookups each (V4.1-Flash's per engram layer), the rows drawn
from a Zipf law of exponent ``--zipf`` over the table (a random permutation of ranks: hashed n-grams land anywhere).
For each cache size (a fraction of the table's rows) and for the table mapped whole (what loading with ``mmap``
and no budget does), it reports the hit rate, bytes read from the file a token, microseconds a token, and the growth
of this process's resident memory. The file's pages are dropped from the page cache first
(``posix_fadvise(DONTNEED)``), so misses read the disk. Real text's row ids come from hashed n-grams, whose
frequencies follow the n-grams' own (Zipfian) law; the exponent here is an assumption, printed with the results.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashserve.model.checkpoint import _read_headers, _row_reader, _Source  # noqa: E402
from flashserve.model.mapped import FileReader, MappedFiles  # noqa: E402
from flashserve.model.packed import TABLE_FP8, PackedEmbedding  # noqa: E402
from flashserve.model.row_cache import RowCache  # noqa: E402

DIM, LOOKUPS = 256, 24


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write(path: Path, rows: int) -> None:
    chunk = 1 << 20
    q = torch.empty(rows, DIM, dtype=torch.uint8)
    for i in range(0, rows, chunk):  # distinct bytes a row, so a wrong row would show
        n = min(chunk, rows - i)
        q[i:i + n] = torch.randint(0, 120, (n, DIM), dtype=torch.uint8)
    s = torch.full((rows, DIM // 32), 127, dtype=torch.uint8)
    save_file({"t.weight": q.view(torch.float8_e4m3fn), "t.scale": s.view(torch.float8_e8m0fnu)}, str(path))


def _ids(rows: int, tokens: int, zipf: float, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** zipf
    cdf = np.cumsum(weights)
    ranks = np.searchsorted(cdf, rng.random(tokens * LOOKUPS) * cdf[-1])
    perm = rng.permutation(rows)
    return torch.from_numpy(perm[ranks].reshape(tokens, LOOKUPS).astype(np.int64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05, 0.2])
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        path = Path(tmp) / "table.safetensors"
        _write(path, args.rows)
        headers = _read_headers([path])
        src = _Source("t.weight", headers["t.weight"], headers["t.scale"], (args.rows, DIM))
        ids = _ids(args.rows, args.tokens, args.zipf)
        row_bytes = DIM + DIM // 32
        print(f"table {args.rows} rows x {row_bytes} bytes ({args.rows * row_bytes / 2**30:.2f} GiB); "
              f"{args.tokens} tokens x {LOOKUPS} lookups, Zipf exponent {args.zipf}; "
              f"{len(ids.unique())} distinct rows named")
        samples = {}
        for fraction in args.fractions:
            _drop(path)
            slots = max(int(args.rows * fraction), 16)
            files = FileReader()
            before = _rss()
            held = PackedEmbedding(slots, DIM, TABLE_FP8)
            cache = RowCache(args.rows, held, _row_reader(src, 1, 32, files))
            t0 = time.perf_counter()
            with torch.inference_mode():
                for t in range(args.tokens):
                    cache.prefetch(ids[t])
                    out = cache(ids[t])
                    if t % 997 == 0:
                        samples.setdefault(t, out)
            dt = time.perf_counter() - t0
            c = cache.counts()
            looked = c["hits"] + c["misses"]
            print(f"cache {fraction:5.1%} ({cache.slots} rows, {cache.slots * row_bytes / 2**20:7.1f} MiB): hit rate "
                  f"{100 * c['hits'] / looked:5.1f}%, {c['bytes_read'] / args.tokens / 1e3:6.2f} KB read a token, "
                  f"{dt / args.tokens * 1e6:8.1f} us a token, resident +{(_rss() - before) / 2**20:7.1f} MiB")
            files.close()
            del cache, held
        # the whole table mapped (loading with mmap and no budget): each named row's page read on first touch and
        # kept resident
        _drop(path)
        maps = MappedFiles()
        h = headers["t.weight"], headers["t.scale"]
        with torch.device("meta"):
            whole = PackedEmbedding(args.rows, DIM, TABLE_FP8)
        before = _rss()
        whole.packed.adopt(maps.tensor(path, h[0].dtype, h[0].shape, h[0].start, h[0].end),
                           maps.tensor(path, h[1].dtype, h[1].shape, h[1].start, h[1].end))
        t0 = time.perf_counter()
        with torch.inference_mode():
            for t in range(args.tokens):
                out = whole(ids[t])
                if t in samples:
                    assert torch.equal(out, samples[t]), "the row cache gave other rows than the table"
        dt = time.perf_counter() - t0
        print(f"mapped whole:  {dt / args.tokens * 1e6:8.1f} us a token, resident +{(_rss() - before) / 2**20:8.1f} "
              f"MiB (every named row's page)")
        print(f"peak resident {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
