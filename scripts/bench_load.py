"""Load time and resident memory of a checkpoint, memory-mapped (the default) against copied (``--no-mmap``).

    python scripts/bench_load.py SLICE_DIR [--dtypes float32 bfloat16] [--repeats 3]

Each load runs in a fresh process (alternating the modes, so the page cache is as warm for one as for the other)
and reports: seconds until ``load_model`` returns (the model ready, before any page of a mapped tensor is
touched), the process's resident memory then (anonymous: copies; file-backed: mapped pages already read), and the
load report's bytes mapped and copied. Medians over ``--repeats``. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import json, sys, time
from flashserve.model.loader import load_model

path, dtype, mmap = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
t = time.perf_counter()
model = load_model(path, dtype=dtype, with_mtp=False, mmap=mmap)
seconds = time.perf_counter() - t
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kb = lambda key: int(status[key].split()[0]) * 1024
r = model.load_report
print(json.dumps({"seconds": seconds, "rss": kb("VmRSS"), "anon": kb("RssAnon"), "file": kb("RssFile"),
                  "mapped": sum(r.mapped.values()), "copied": sum(r.copied.values()), "describe": r.describe()}))
"""


def run(path: Path, dtype: str, mmap: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), dtype, "1" if mmap else "0"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("slice", type=Path)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    gib = 2 ** 30
    for dtype in args.dtypes:
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(args.repeats):
            for mmap in (True, False):
                runs[mmap].append(run(args.slice, dtype, mmap))
        for mmap in (True, False):
            rs = runs[mmap]
            med = {k: statistics.median(r[k] for r in rs) for k in ("seconds", "rss", "anon", "file")}
            each = ", ".join(f"{r['seconds']:.2f}" for r in rs)
            print(f"{dtype} {'mmap   ' if mmap else 'no-mmap'}: ready in {med['seconds']:.2f} s (median of "
                  f"{len(rs)}: {each}), resident {med['rss'] / gib:.2f} GiB "
                  f"({med['anon'] / gib:.2f} anonymous, {med['file'] / gib:.2f} file pages)")
            print(f"    {rs[-1]['describe']}")
        ratio = statistics.median(r["seconds"] for r in runs[False]) / statistics.median(
            r["seconds"] for r in runs[True])
        print(f"{dtype}: mapped loads {ratio:.2f}x as fast as copied")


if __name__ == "__main__":
    main()
