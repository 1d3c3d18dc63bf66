"""Sharded engine on the CPU (gloo): bytes each collective moves per decode step, measured, against
``flashserve plan``'s link-bytes terms for the same tiny layout, and the step time of 2 ranks against 1.

    python scripts/bench_parallel.py [--model tiny-v41] [--concurrency 8] [--output 32] [--json out.json]

Decode steps only: counters are reset and steps timed once every request has finished its prefill. Weights,
activations and collectives are bf16, as the planner assumes (dense bf16 with --weight-dtype bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _plan(model: str, layout: dict, concurrency: int, ctx: float) -> dict:
    from flashserve.plan.inputs import PlanInputs
    from flashserve.plan.planner import build_deployment
    from flashserve.plan.roofline import decode_step

    tp = layout.get("tensor_parallel_size", 1)
    dp = layout.get("data_parallel_size", 1)
    gpus = tp * dp
    ep = gpus if layout.get("enable_expert_parallel") else 1
    dep = build_deployment(PlanInputs(model=model, hardware="h200", gpus=gpus, tp=tp, ep=ep, attention_dp=dp,
                                      weight_dtype="bf16", stack="none"))
    s = decode_step(dep, concurrency, ctx)
    return {"comm_bytes_tp": s.comm_bytes_tp, "comm_bytes_ep": s.comm_bytes_ep}


def run(model: str, layout: dict, concurrency: int, prompt: int, output: int) -> dict:
    from flashserve.entrypoints.llm import LLM
    from flashserve.engine.sampling_params import SamplingParams

    llm = LLM(model, dtype="bfloat16", kv_memory="64MiB", max_num_seqs=concurrency, threads=1, **layout)
    eng = llm.engine
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        eng.add_request(f"r{i}", [(13 * i + j) % 400 + 1 for j in range(prompt)], params)
    sharded = hasattr(eng, "collective_counters")
    times = []
    decoding = False
    while eng.has_unfinished_requests():
        if not decoding:
            running = eng.scheduler.running if not sharded or eng.layout.dp == 1 else None
            # decoding once every request is past its prefill (DP: rank 0's view after the first outputs)
            decoding = eng.generation_tokens_total >= concurrency if running is not None else bool(times) or (
                eng.num_steps >= 2)
            if decoding and sharded:
                eng.collective_counters()  # reset
        t0 = time.perf_counter()
        eng.step()
        if decoding:
            times.append(time.perf_counter() - t0)
    out = {"layout": layout, "decode_steps": len(times), "median_step_ms": 1e3 * statistics.median(times)}
    if sharded:
        counters = eng.collective_counters()[0]
        n = max(len(times), 1)
        out["per_step"] = {k: {"calls": v["calls"] / n, "payload_bytes": v["payload_bytes"] / n,
                               "link_bytes": v["link_bytes"] / n} for k, v in counters.items()}
        out["plan"] = _plan(model, layout, concurrency, prompt + output / 2)
        eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-v41")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layouts = [{}, {"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "enable_expert_parallel": True},
               {"data_parallel_size": 2, "enable_expert_parallel": True}]
    results = [run(args.model, lay, args.concurrency, args.prompt, args.output) for lay in layouts]
    base = results[0]["median_step_ms"]
    for r in results:
        print(f"{json.dumps(r['layout']) or '{}':>70}  decode step median {r['median_step_ms']:.2f} ms "
              f"({r['median_step_ms'] / base:.2f}x one rank, {r['decode_steps']} steps)")
        for k, v in r.get("per_step", {}).items():
            print(f"    {k:24} {v['calls']:6.1f} calls/step  payload {v['payload_bytes']:10.0f} B  "
                  f"link {v['link_bytes']:10.0f} B/step")
        if "plan" in r:
            print(f"    plan: TP link bytes {r['plan']['comm_bytes_tp']:.0f} B/step, EP link bytes "
                  f"{r['plan']['comm_bytes_ep']:.0f} B/step (per GPU)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
