"""Each planner term on small hand-computed cases."""

from __future__ import annotations

import json

import pytest

from flashserve.plan.errors import PlanError
from flashserve.plan.model_terms import LayerAttention, expected_distinct_experts
from flashserve.plan.models import resolve_model
from flashserve.plan.planner import cost_per_million
from flashserve.plan.v3 import V3_671B, mla_row_bytes


def test_expected_distinct_experts_small_cases() -> None:
    assert expected_distinct_experts(4, 1, 2) == pytest.approx(4 * (1 - 0.75**2))  # 1.75
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8.0)  # one token touches exactly k
    assert expected_distinct_experts(256, 8, 0) == 0.0
    assert expected_distinct_experts(8, 8, 3) == pytest.approx(8.0)  # k = E touches all
    assert expected_distinct_experts(384, 6, 10_000) == pytest.approx(384.0, rel=1e-9)  # saturates at E
    # more tokens never touch fewer experts
    seq = [expected_distinct_experts(384, 6, b) for b in (1, 2, 8, 64, 512)]
    assert seq == sorted(seq)


def _csa2_layer(cap: int = 0) -> LayerAttention:
    return LayerAttention(window=128, window_row_bytes=528, ratio=2, topk=512, main_row_bytes=288, heads=2,
                          qk_dim=4, v_dim=4, scan_ratio=2, scan_cap=cap, index_row_bytes=68, index_flops_per_row=10)


def test_sparse_kv_bytes_short_context() -> None:
    # ctx 100: 100 window rows, 50 entries (all selected), 50 index rows scanned
    assert _csa2_layer().read_bytes(100) == pytest.approx(100 * 528 + 50 * 288 + 50 * 68)


def test_sparse_kv_bytes_long_context_selects_topk_not_context() -> None:
    layer = _csa2_layer()
    assert layer.read_bytes(10_000) == pytest.approx(128 * 528 + 512 * 288 + 5_000 * 68)
    capped = _csa2_layer(cap=1_000)
    assert capped.read_bytes(10_000) == pytest.approx(128 * 528 + 512 * 288 + 1_000 * 68)


def test_attention_flops_hand_case() -> None:
    layer = LayerAttention(window=128, window_row_bytes=1, ratio=0, topk=0, main_row_bytes=0, heads=2, qk_dim=4, v_dim=4)
    assert layer.flops(10) == pytest.approx(2 * 2 * 10 * (4 + 4))
    assert _csa2_layer().flops(100) == pytest.approx(2 * 2 * (100 + 50) * 8 + 50 * 10)


def test_v41_flash_headline_arithmetic() -> None:
    m = resolve_model("deepseek-v41-flash")
    assert m.kv_bytes_per_token == pytest.approx(890.0)
    assert m.params_total / 1e9 == pytest.approx(551.88, abs=0.05)
    assert m.params_active_decode / 1e9 == pytest.approx(16.1, abs=0.1)
    assert m.params_active_prefill / 1e9 == pytest.approx(7.9, abs=0.1)
    assert m.prefill_layers == 20 and m.draft.kind == "dspark" and m.draft.layers == 3


def test_v41_kv_read_at_1m_context_is_window_plus_topk_plus_index_scan() -> None:
    m = resolve_model("deepseek-v41-flash")
    ctx = 1_000_000
    window = 40 * 128 * 528  # every layer's FP8 window ring
    selected = 38 * 512 * 288  # layers 2-39 read 512 FP4 main rows
    scans = (3 * ctx / 2 + ctx + 4 * 16_384) * 68  # indexers: 2, 8, 14 (ratio 2), 20 (all), 24-36 (pool)
    assert m.kv_read_bytes(ctx) == pytest.approx(window + selected + scans)
    assert m.kv_read_bytes(ctx) < 0.25 * m.kv_bytes_per_token * ctx  # far less than the whole cache


def test_v41_fp8_kv_records() -> None:
    assert resolve_model("deepseek-v41-flash", "fp8").kv_bytes_per_token == pytest.approx(2.5 * (528 + 132))


def test_deepseek_r1_terms() -> None:
    m = resolve_model("deepseek-r1")
    assert m.params_total / 1e9 == pytest.approx(671.0, abs=0.5)
    assert m.params_active_decode / 1e9 == pytest.approx(37.0, abs=0.6)
    assert m.kv_bytes_per_token == 61 * 1152 == 70_272  # bf16 MLA latent, reference-figures §5
    assert mla_row_bytes(512, 64, "fp8") == 656  # FlashMLA FP8 record
    assert m.kv_read_bytes(2048) == pytest.approx(2048 * 70_272)  # dense MLA reads the whole context


def test_v3_config_json_path(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V3_671B))
    assert resolve_model(str(tmp_path)).params_total == resolve_model("deepseek-v3").params_total
    path.write_text(json.dumps({**V3_671B, "model_type": "llama"}))
    with pytest.raises(PlanError, match="model_type"):
        resolve_model(str(path))
    path.write_text(json.dumps({**V3_671B, "hidden_size": -1}))
    with pytest.raises(PlanError, match="hidden_size"):
        resolve_model(str(path))


def test_cost_formula() -> None:
    # InferenceX: $2.65/GPU-hour at 11,951 tokens/s per GPU → $0.06 per million
    assert cost_per_million(2.65, 1, 11_951) == pytest.approx(2.65e6 / (3600 * 11_951))
    assert round(cost_per_million(2.65, 1, 11_951), 2) == 0.06
    assert cost_per_million(2.0, 144, 144 * 1850) == pytest.approx(0.3003, abs=1e-4)
    assert cost_per_million(1.0, 1, 0) == float("inf")
