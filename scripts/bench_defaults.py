"""Per-agent decode at batch 1 on the embedded model: the engine with no flags against the earlier default
(eager, one thread, no speculation), each in a fresh process, alternating, medians. Each is measured settled:
after a first short request and the background compile it asked for (inductor's cache is shared by the runs, so
only the first compiles from nothing; ``scripts/bench_cold_start.py`` measures the start itself).

    python scripts/bench_defaults.py [--repeats 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):", "class Parser:\n    def __init__(self",
           "    for key, value in sorted(items.items()):"]
CHILD = r"""
import json, statistics, sys, time
from flashserve import LLM, SamplingParams
opts = json.loads(sys.argv[1]); new = int(sys.argv[2]); prompts = json.loads(sys.argv[3])
llm = LLM(**opts)
eng = llm.engine
# settled: one short request first (it asks for the shapes a step verifies drafts in), then the compile finished
for o in llm.stream(prompts[0], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)):
    pass
t_wait = time.perf_counter()
eng.wait_compiled()
waited = time.perf_counter() - t_wait
out = {}
for temp in (0.0, 1.0):
    rates = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=new, temperature=temp, seed=i, ignore_eos=True, output_kind="delta")
        t0 = time.perf_counter(); first = None; n = 0
        for o in llm.stream(p, sp):
            n += len(o.outputs[0].token_ids)
            if first is None:
                first = time.perf_counter()
        rates.append((n - 1) / (time.perf_counter() - first))
    out["greedy" if temp == 0 else "sampled"] = statistics.median(rates)
out["threads"] = __import__("torch").get_num_threads()
out["step"] = eng.stats()["decode_step"]
out["waited_s"] = waited
out["spec"] = eng.spec.method if eng.spec else "none"
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    setups = {"earlier default (eager, 1 thread, no speculation)": {"threads": 1, "speculative_config": "off",
                                                                     "enforce_eager": True},
              "no flags": {}}
    runs: dict[str, list[dict]] = {k: [] for k in setups}
    for _ in range(a.repeats):
        for name, opts in setups.items():
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(opts), str(a.tokens), json.dumps(PROMPTS)],
                                 env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs[name].append(json.loads(out))
    for k in ("greedy", "sampled"):
        old_v, new_v = (statistics.median(r[k] for r in runs[n]) for n in setups)
        print(f"{k:>8}: earlier default {old_v:6.1f} tok/s, no flags {new_v:6.1f} tok/s ({runs['no flags'][0]['threads']} "
              f"threads, {runs['no flags'][0]['spec']}): {new_v / old_v:.2f}x")
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
