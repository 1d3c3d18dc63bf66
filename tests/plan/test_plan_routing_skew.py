"""Skewed routing: the experts' popularity, the distinct experts a step reads, an LRU expert cache's hit rate,
and what they do to plans, on cases computed here by hand; V4-Flash's exponent against the measured shares
it rests on."""

from __future__ import annotations

import math

import pytest

from flashserve.plan.engine_runs import run_points
from flashserve.plan.model_terms import expected_distinct_experts, expert_popularity, lru_hit_rate
from flashserve.plan.models import resolve_model
from flashserve.plan.scenarios import PUBLISHED_LOCAL
from flashserve.plan.v4_terms import ROUTING_SKEW
from tier_box import BOX, CTX, FP4, MODEL, TERMS, plan_error, plan_json, write_machine


def test_popularity_is_zipf_and_sums_to_top_k() -> None:
    # four experts, one pick a token, exponent 1: weights 1, 1/2, 1/3, 1/4 of 25/12
    assert expert_popularity(4, 1, 1.0) == pytest.approx([12 / 25, 6 / 25, 4 / 25, 3 / 25])
    assert expert_popularity(5, 2, 0.0) == [0.4] * 5
    # two picks, exponent 2: the first would be picked 2/(1 + 1/4 + 1/9 + 1/16) = 1.405 times a token; it is
    # capped at 1 and the others share the rest (1) in the ratio 1/4 : 1/9 : 1/16
    w = [1 / 4, 1 / 9, 1 / 16]
    assert expert_popularity(4, 2, 2.0) == pytest.approx([1.0] + [x / sum(w) for x in w])


def test_distinct_experts_under_skew_by_hand() -> None:
    q = [12 / 25, 6 / 25, 4 / 25, 3 / 25]
    assert expected_distinct_experts(4, 1, 3, 1.0) == pytest.approx(sum(1 - (1 - x) ** 3 for x in q))
    assert expected_distinct_experts(4, 1, 3, 0.0) == pytest.approx(4 * (1 - 0.75 ** 3))
    # one token touches exactly k whatever the skew; skew makes tokens share experts, never touch more
    assert expected_distinct_experts(256, 6, 1, ROUTING_SKEW) == pytest.approx(6.0)
    for b in (2, 8, 64):
        assert expected_distinct_experts(256, 6, b, ROUTING_SKEW) < expected_distinct_experts(256, 6, b)


def test_lru_hit_rate_by_hand() -> None:
    # two experts picked 2/3 and 1/3 of the time, a cache of one: Che's time T solves
    # (1 - x^2) + (1 - x) = 1 with x = exp(-T/3), so x = (sqrt(5) - 1)/2 and the hit rate is
    # 2/3 (1 - x^2) + 1/3 (1 - x) = (1 + x)/3
    x = (math.sqrt(5) - 1) / 2
    assert lru_hit_rate(2, 1, 1, 1.0) == pytest.approx((1 + x) / 3, rel=1e-9)
    # a step of two rows touches the first expert with probability 8/9 and the second 5/9: the share of the
    # step's touched experts an LFU cache of the first holds is 8/13 (a cache counts each touched expert once)
    from flashserve.plan.model_terms import lfu_hit_rate

    assert lfu_hit_rate(2, 1, 1, 1.0, tokens=2) == pytest.approx(8 / 13, rel=1e-12)
    assert lfu_hit_rate(2, 1, 1, 1.0) == pytest.approx(2 / 3, rel=1e-12)
    # without skew a cache holds its share, as a static set does, at any step size
    assert lru_hit_rate(384, 6, 223, 0.0, tokens=8) == pytest.approx(223 / 384, rel=1e-9)
    assert lru_hit_rate(384, 6, 223, 0.0) == pytest.approx(223 / 384, rel=1e-9)
    assert lru_hit_rate(384, 6, 0, ROUTING_SKEW) == 0.0 and lru_hit_rate(384, 6, 384, ROUTING_SKEW) == 1.0
    # the used experts stay: more than the share, less than the most used 223's own share
    top = sum(expert_popularity(384, 6, ROUTING_SKEW)[:223]) / 6
    assert 223 / 384 < lru_hit_rate(384, 6, 223, ROUTING_SKEW) < top


def test_v4_exponent_reproduces_the_measured_shares() -> None:
    """colibri issue 864: V4-Flash's most used 8/16/32/64 of 256 experts take 35.6/46.5/58.5/71.2% of a
    layer's selections."""
    q = expert_popularity(256, 6, ROUTING_SKEW)
    for n, share in ((8, 0.356), (16, 0.465), (32, 0.585), (64, 0.712)):
        assert sum(q[:n]) / 6 == pytest.approx(share, abs=0.01), n
    assert resolve_model("deepseek-v4-flash").routing_skew == ROUTING_SKEW
    assert resolve_model("deepseek-v41-flash").routing_skew == ROUTING_SKEW
    assert resolve_model("deepseek-r1").routing_skew == 0.0  # no measured curve: uniform


def test_a_step_reads_the_distinct_experts_of_its_skew(tmp_path, capsys) -> None:
    """Eight sequences on the tier box with a GPU large enough for every expert: the routed bytes are the
    distinct experts of 8 tokens at the model's skew, or at the one --routing-skew gives."""
    box = write_machine(tmp_path, {**BOX, "gpu": {**BOX["gpu"], "memory_gib": 400}})
    m = resolve_model(MODEL)
    per_expert = m.n_moe_layers * m.expert_params * FP4
    base = ["--hardware", box, "--model", MODEL, "--context", str(CTX), "--concurrency", "8", *TERMS]
    for flag, skew in (([], ROUTING_SKEW), (["--routing-skew", "0"], 0.0), (["--routing-skew", "1.5"], 1.5)):
        d = plan_json(capsys, base + flag)
        q = expert_popularity(256, 6, skew)
        distinct = sum(1 - (1 - x) ** 8 for x in q)
        assert d["step"]["distinct_experts_per_layer"] == pytest.approx(distinct, rel=1e-9), skew
        assert d["step"]["bytes_experts"] == pytest.approx(distinct * per_expert, rel=1e-9), skew
    assert plan_error(capsys, ["--model", MODEL, "--hardware", "h100", "--routing-skew", "-1"]) == "--routing-skew"


def test_an_lru_cache_of_resident_experts_hits_at_the_skews_rate(tmp_path, capsys) -> None:
    """16 experts a layer resident as an LRU cache, 240 in host memory: the GPU reads the hit share of the
    selected experts, the CPU the rest; as a static set the GPU reads 16/256 of them."""
    box = write_machine(tmp_path, BOX)
    base = ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS, "--resident-experts", "16"]
    m = resolve_model(MODEL)
    selected = m.n_moe_layers * 6 * m.expert_params * FP4
    lru = plan_json(capsys, base + ["--expert-cache", "lru"])
    hit = lru_hit_rate(256, 6, 16, ROUTING_SKEW)
    assert lru["machine"]["placement"]["expert_hit_rate"] == pytest.approx(hit, rel=1e-12)
    assert lru["machine"]["placement"]["expert_hit_rate_from"] == "lru"
    assert lru["step"]["bytes_host_experts"] == pytest.approx((1 - hit) * selected, rel=1e-9)
    static = plan_json(capsys, base)
    assert static["step"]["bytes_host_experts"] == pytest.approx(240 / 256 * selected, rel=1e-9)
    assert lru["tokens_per_s_per_agent"] > static["tokens_per_s_per_agent"]
    # a measured hit rate is the other way to say it; the two together, or a cache with nothing placed, are refused
    assert plan_error(capsys, base + ["--expert-cache", "lru", "--expert-hit-rate", "0.5"]) == "--expert-cache"
    assert plan_error(capsys, ["--hardware", box, "--model", MODEL, "--expert-cache", "lru"]) == "--expert-cache"
    # a cache of every expert misses nothing
    assert plan_error(capsys, base[:-2] + ["--resident-experts", "256", "--expert-cache", "lru"]) == "--expert-cache"
    # eight sequences: the hit rate is that of a step's touched experts
    eight = plan_json(capsys, base + ["--expert-cache", "lru", "--concurrency", "8"])
    assert eight["machine"]["placement"]["expert_hit_rate"] == pytest.approx(
        lru_hit_rate(256, 6, 16, ROUTING_SKEW, tokens=8), rel=1e-12)
    assert eight["machine"]["placement"]["expert_hit_rate"] < hit


def test_slice_runs_are_planned_with_uniform_routing() -> None:
    """A slice's router weights are random: its plan must not credit V4-Flash's measured skew."""
    run = {"slice": "/nonexistent", "prompt_len": 32, "new_tokens": 16, "rows": [{"batch": 16, "tok_s": 30.0}]}
    (point,) = run_points(run, "cpu-local", config="deepseek-v4-flash")
    assert point.inputs.routing_skew == 0.0


def test_the_ds4_ssd_point_is_planned_as_its_lru_cache() -> None:
    strix = next(p for p in PUBLISHED_LOCAL if p.name == "ds4-strix-halo-v41-q2-ssd")
    assert strix.inputs.expert_cache == "lru" and strix.inputs.resident_experts == 223


def test_a_prefill_chunk_touches_the_distinct_experts_of_its_skew(tmp_path, capsys) -> None:
    """512 prompt tokens of V4-Flash touch Σ 1 − (1 − qᵢ)^512 experts a layer at the model's skew."""
    box = write_machine(tmp_path, BOX)
    d = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS,
                           "--resident-experts", "16", "--prefill-chunk", "512"])
    touched = sum(1 - (1 - x) ** 512 for x in expert_popularity(256, 6, ROUTING_SKEW))
    assert d["prefill"]["tiers"]["experts_touched_per_layer"] == pytest.approx(touched, rel=1e-9)
    assert touched < 255  # uniform routing touches 256.0
