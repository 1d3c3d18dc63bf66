"""Greedy tokens of a checkpoint under a weight budget against the engine that maps every weight, same prompts.

    python scripts/budget_tokens.py DIR --weight-memory 14GiB [--steps 32] [--prompts 2] [--enforce-eager]

Runs the mapped engine (no budget) and then the budgeted one, each in a process of its own (one at a time: a slice
larger than memory is read as each runs, and nothing of the first stays), decodes ``--steps`` greedy tokens for
each of ``--prompts`` prompts of token ids, and says whether they are equal, with each engine's decode time. Not a
test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def greedy(path: Path, weight_memory: str | None, prompts: list[list[int]], steps: int, eager: bool) -> tuple:
    from flashserve.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(path), weight_memory=weight_memory, speculative_config="off",
                                    max_num_seqs=len(prompts), max_model_len=1024, kv_memory="1GiB",
                                    enforce_eager=eager))
    engine.wait_compiled()
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    seconds = time.perf_counter() - t
    stats = engine.stats().get("expert_cache")
    engine.shutdown()
    return [out[str(i)] for i in range(len(prompts))], seconds, stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slice", type=Path)
    ap.add_argument("--weight-memory", required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--side", choices=("mapped", "budget"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(24 + 8 * i)] for i in range(args.prompts)]
    if args.side is not None:  # one engine, in this process: its tokens as JSON on the last line
        tokens, seconds, stats = greedy(args.slice, args.weight_memory if args.side == "budget" else None, prompts,
                                        args.steps, args.enforce_eager)
        print(json.dumps({"tokens": tokens, "seconds": seconds, "stats": stats}))
        return 0

    def side(name: str) -> dict:
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", name], capture_output=True,
                              text=True)
        if done.returncode:
            raise SystemExit(f"the {name} engine failed ({done.returncode}): {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = side("mapped"), side("budget")
    mapped, t_mapped = first["tokens"], first["seconds"]
    budget, t_budget, stats = second["tokens"], second["seconds"], second["stats"]
    same = [a == b for a, b in zip(mapped, budget)]
    print(f"mapped, no budget: {t_mapped:.1f} s; budget {args.weight_memory}: {t_budget:.1f} s; expert cache {stats}")
    for i, (a, b) in enumerate(zip(mapped, budget)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        print(f"prompt {i}: {'equal' if first is None else f'differ from step {first}'} ({len(a)} tokens)")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
