"""Cold and warm compile of the decode step: ``tiny-v41`` at its 10 layers and at the real model's 40 (the same
sizes, ``with_layout``), each engine built in a fresh process with an empty inductor cache (cold), then again
over the cache the cold run left (warm). ``--before TREE`` adds the same runs of another checkout (a
``git worktree``) first, for a same-run comparison.

    python scripts/bench_compile.py [--before /tmp/before] [--layers 10 40] [--max-num-seqs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from flashserve.config.model_config import config_from_dict
from flashserve.config.presets import preset_json
from flashserve.engine import EngineConfig, LLMEngine
from flashserve.model.init import random_init
from flashserve.model.transformer import Transformer
layers, seqs = int(sys.argv[1]), int(sys.argv[2])
if layers == 10:
    raw = preset_json("tiny-v41")
else:
    from flashserve.config.presets import with_layout
    raw = with_layout("tiny-v41", "deepseek-v41-flash")
model = random_init(Transformer(config_from_dict(raw), with_mtp=False), seed=0).eval()
t1 = time.perf_counter()
engine = LLMEngine(EngineConfig(model="tiny-v41", enforce_eager=False, max_num_seqs=seqs, speculative_config="off"),
                   model=model)
t2 = time.perf_counter()
step = engine.runner.decode_step
kinds = len(step.regions.kinds) if getattr(step, "regions", None) is not None else None
print(json.dumps({"engine_s": t2 - t1, "warmup_s": step.warmup_s, "kinds": kinds, "buckets": step.buckets}))
"""


def run(tree: str | None, layers: int, seqs: int, cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["TORCHINDUCTOR_CACHE_DIR"] = cache
    if tree:
        env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-c", CHILD, str(layers), str(seqs)], env=env, check=True,
                         capture_output=True, text=True, cwd=tree or None).stdout.strip().splitlines()[-1]
    return json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another checkout to measure first (its 10-layer engine only)")
    ap.add_argument("--layers", type=int, nargs="+", default=[10, 40])
    ap.add_argument("--max-num-seqs", type=int, default=4)
    a = ap.parse_args()
    results = {}
    trees = ([("before", a.before, [10])] if a.before else []) + [("this tree", None, a.layers)]
    for label, tree, layer_counts in trees:
        for layers in layer_counts:
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                cold = run(tree, layers, a.max_num_seqs, cache)
                warm = run(tree, layers, a.max_num_seqs, cache)
            results[f"{label}, {layers} layers"] = {"cold": cold, "warm": warm}
            print(f"{label:>10}, {layers:2d} layers: compile cold {cold['warmup_s']:6.1f} s, warm {warm['warmup_s']:5.1f} s "
                  f"(engine {cold['engine_s']:.1f} / {warm['engine_s']:.1f} s; region kinds {cold['kinds']}; "
                  f"buckets {cold['buckets']})", flush=True)
    mine = [results[f"this tree, {n} layers"]["cold"]["warmup_s"] for n in (10, 40) if n in a.layers]
    if len(mine) == 2:
        print(f"40-layer cold compile / 10-layer: {mine[1] / mine[0]:.2f}x")
    if a.before and 10 in a.layers:
        b = results["before, 10 layers"]["cold"]["warmup_s"]
        print(f"10-layer cold compile, before / this tree: {b / mine[0]:.2f}x")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
