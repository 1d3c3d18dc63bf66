"""Decode and prefill with one thread against the default thread count (engine/threads.py), alternating in
fresh processes, medians.

    python scripts/bench_threads.py [--model M] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
from flashserve import LLM, SamplingParams
threads = None if sys.argv[1] == "default" else int(sys.argv[1])
llm = LLM(sys.argv[2] or None, threads=threads, max_num_seqs=16, enable_prefix_caching=False)
eng = llm.engine
tok = eng.tokenizer
text = open(sys.argv[3]).read()
ids = tok.encode(text)
def run(prompts, new):
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, output_kind="delta")
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}-{t0}", p, sp)
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t0
def prefill(n):
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    eng.add_request(f"p{n}-{t0}", ids[:n], sp)
    while eng.has_unfinished_requests():
        eng.step()
    return n / (time.perf_counter() - t0)
def decode(batch, new=64):  # decode-only: a run of new + 1 tokens minus a run of 1
    prompts = [ids[i * 32:(i + 1) * 32] for i in range(batch)]
    short = run(prompts, 1)
    full = run(prompts, new + 1)
    return batch * new / (full - short)
prefill(256)  # warm-up
out = {"threads": torch.get_num_threads(), "prefill_2k": prefill(2048), "decode_1": decode(1), "decode_16": decode(16)}
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="preset or checkpoint (default: the embedded model)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import flashserve

    corpus = os.path.join(os.path.dirname(flashserve.__file__), "engine", "llm_engine.py")  # 2K+ tokens of text
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    rows: dict[str, list[dict]] = {"1": [], "default": []}
    for _ in range(a.repeats):
        for which in rows:
            out = subprocess.run([sys.executable, "-c", CHILD, which, a.model, corpus], env=env, check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            rows[which].append(json.loads(out))
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in rows.items()}
    for k in ("prefill_2k", "decode_1", "decode_16"):
        print(f"{k:>10}: 1 thread {med['1'][k]:8.1f} tok/s, default ({med['default']['threads']:.0f} threads) "
              f"{med['default'][k]:8.1f} tok/s: {med['default'][k] / med['1'][k]:.2f}x")
    print(json.dumps({"runs": rows, "medians": med}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
