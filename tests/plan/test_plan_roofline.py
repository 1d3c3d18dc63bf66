"""The decode step on a synthetic model and device whose terms can be computed by hand."""

from __future__ import annotations

import pytest

from flashserve.plan.hardware import Efficiency, Hardware
from flashserve.plan.model_terms import NO_DRAFT, LayerAttention, ModelTerms, expected_distinct_experts
from flashserve.plan.roofline import COMBINE_BYTES, DISPATCH_BYTES, Deployment, decode_step

EFF = Efficiency(eta_mem=1.0, eta_flop=1.0, eta_comm=1.0, layer_overhead_us=10.0, pass_overhead_us=5.0,
                 comm_overlap=1.0, workspace_fraction=0.1)
HW = Hardware(name="toy", description="", hbm_bytes=1e11, hbm_usable_bytes=1e11, hbm_bw=1e12,
              flops={"fp8": 1e15, "bf16": 5e14}, scaleup_bw=1e11, scaleup_domain=8, scaleout_bw=1e10,
              host_mem_bytes=0, host_link_bw=0, cost_per_gpu_hour=1.0, efficiency=EFF)
LAYER = LayerAttention(window=0, window_row_bytes=0, ratio=1, topk=0, main_row_bytes=100, heads=4, qk_dim=8, v_dim=8)
MODEL = ModelTerms(
    name="toy", family="deepseek_v3", hidden_size=1000, n_layers=2, n_moe_layers=2, n_experts=16, top_k=2,
    expert_params=1_000_000, dense_params_decode=10_000_000, dense_params_total=12_000_000, prefill_layers=2,
    prefill_moe_layers=2, dense_params_prefill=9_000_000, params_total=44_000_000, host_params=0,
    host_row_bytes_per_token=0.0, attention=(LAYER, LAYER), prefill_attention=(LAYER, LAYER),
    kv_bytes_per_token=200.0, state_bytes_per_sequence=0.0, kv_dtype="fp8", draft=NO_DRAFT)


def _dep(gpus: int = 2, tp: int = 1, ep: int = 2) -> Deployment:
    return Deployment(model=MODEL, hw=HW, eff=EFF, gpus=gpus, tp=tp, ep=ep, dp=gpus // tp,
                      expert_dtype="fp8", dense_dtype="fp8")


def test_bytes_per_step_by_hand() -> None:
    s = decode_step(_dep(), concurrency=4, ctx=1000)
    distinct = expected_distinct_experts(16, 2, 4)
    assert s.sequences_per_rank == 2
    assert s.bytes_dense == pytest.approx(10e6)  # FP8: 1 byte per weight, TP1
    assert s.bytes_experts == pytest.approx(2 * distinct * 1e6 / 2)
    assert s.bytes_kv == pytest.approx(2 * 2 * 1000 * 100)  # 2 local sequences × 2 layers × 1000 rows
    assert s.t_mem == pytest.approx(s.bytes_total / 1e12)


def test_flops_comm_and_step_time_by_hand() -> None:
    s = decode_step(_dep(), concurrency=4, ctx=1000)
    assert s.flops_dense == pytest.approx(2 * 10e6 * 2)
    assert s.flops_experts == pytest.approx(2 * 2 * 2 * 1e6 * 4 / 2)
    assert s.flops_attention == pytest.approx(2 * 2 * (2 * 4 * 1000 * 16))
    pairs = 2 * 2 * 4  # layers × top-k × tokens
    assert s.comm_bytes_ep == pytest.approx(pairs * 0.5 * 1000 * (DISPATCH_BYTES + COMBINE_BYTES) / 2)
    assert s.t_comm == pytest.approx(s.comm_bytes_ep / 1e11)
    assert s.t_overhead == pytest.approx((2 * 10 + 5) * 1e-6)
    assert s.t_step == pytest.approx(max(s.t_mem, s.t_flop, s.t_comm) + s.t_overhead)  # full overlap


def test_no_overlap_adds_communication() -> None:
    from dataclasses import replace

    dep = replace(_dep(), eff=replace(EFF, comm_overlap=0.0))
    s = decode_step(dep, concurrency=4, ctx=1000)
    assert s.t_step == pytest.approx(max(s.t_mem, s.t_flop) + s.t_comm + s.t_overhead)


def test_tensor_parallel_splits_weights_not_latent_cache() -> None:
    s1 = decode_step(_dep(gpus=2, tp=1), concurrency=2, ctx=500)
    s2 = decode_step(_dep(gpus=2, tp=2), concurrency=2, ctx=500)
    assert s2.bytes_dense == pytest.approx(s1.bytes_dense / 2)
    assert s2.bytes_kv == pytest.approx(2 * s1.bytes_kv)  # both sequences on one rank, latent replicated
    assert s2.comm_bytes_tp > 0 == s1.comm_bytes_tp


def test_ep_traffic_uses_scale_out_beyond_the_domain() -> None:
    assert _dep(gpus=8, ep=8).ep_link[0] == "scale-up"
    assert _dep(gpus=16, ep=16).ep_link == ("scale-out", 1e10)
