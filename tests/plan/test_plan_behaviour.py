"""Planner behaviour: throughput/latency trade-off, capacity, prefill accounting."""

from __future__ import annotations

import math
from dataclasses import replace

from flashserve.plan.inputs import PlanInputs
from flashserve.plan.planner import plan

V41 = PlanInputs(model="deepseek-v41-flash", hardware="gb300-nvl72", gpus=8, concurrency=8, context=8192)


def test_batching_trades_agent_speed_for_gpu_throughput() -> None:
    res = [plan(replace(V41, concurrency=c)) for c in (1, 8, 64, 512)]
    agent = [r.tokens_per_s_per_agent for r in res]
    gpu = [r.output_tokens_per_s_per_gpu for r in res]
    assert agent == sorted(agent, reverse=True) and gpu == sorted(gpu)
    assert res[0].step.bound == "overhead"


def test_sessions_fit_follow_the_memory_formula() -> None:
    r = plan(replace(V41, context=1_000_000))
    cap, hw = r.capacity, r.deployment.hw
    budget = hw.hbm_usable_bytes * (1 - hw.efficiency.workspace_fraction) - cap.weight_bytes_per_gpu
    per_seq = 890 * 1_000_000 + r.deployment.model.state_bytes_per_sequence
    assert cap.sessions_fit == math.floor(budget / per_seq) * 8
    assert cap.host_table_bytes > 190e9 and cap.host_fits  # engram tables live in host memory


def test_v3_dense_cache_fits_far_fewer_sessions_than_v41() -> None:
    v3 = plan(replace(V41, model="deepseek-r1", kv_dtype="fp8"))
    assert plan(V41).capacity.sessions_fit > 10 * v3.capacity.sessions_fit


def test_prefix_hits_cut_ttft_and_small_prefill_pool_limits_output() -> None:
    long = replace(V41, prompt_len=65536, context=66000, concurrency=512)
    assert plan(replace(long, prefix_hit_rate=0.9)).prefill.ttft_s < plan(long).prefill.ttft_s
    starved = plan(replace(long, prefill_gpus=1))
    roomy = plan(replace(long, prefill_gpus=64))
    assert starved.prefill_limited and not roomy.prefill_limited
    assert starved.output_tokens_per_s < roomy.output_tokens_per_s


def test_prefill_pool_has_its_own_layout() -> None:
    decode = replace(V41, gpus=8, tp=2)
    shared = plan(decode)
    assert shared.prefill_pool is None and shared.prefill_deployment == shared.deployment
    pool = plan(replace(decode, prefill_gpus=16)).prefill_deployment  # EP over the pool, TP 1, DP = 16 / 1
    assert (pool.gpus, pool.tp, pool.ep, pool.dp) == (16, 1, 16, 16)
    given = plan(replace(decode, prefill_gpus=16, prefill_tp=4, prefill_ep=8))
    p = given.prefill_deployment
    assert (p.gpus, p.tp, p.ep, p.dp) == (16, 4, 8, 4)  # DP = 16 / 4
    d = given.deployment
    assert (d.gpus, d.tp, d.ep, d.dp) == (8, 2, 8, 4)
    assert given.step.t_step == shared.step.t_step  # the prefill layout leaves the decode step alone


def test_v41_prefill_runs_only_the_encoder() -> None:
    r = plan(V41)
    m = r.deployment.model
    assert m.params_active_prefill < 0.55 * m.params_active_decode
    assert r.prefill.flops_per_token < 2.2 * m.params_active_prefill
