"""The seed's headline (596 → 848 tokens/s per agent) and the verdict on its aggregate claims."""

from __future__ import annotations

from dataclasses import fields

import pytest

from flashserve.plan.hardware import Efficiency
from flashserve.plan.seed import SEED_BEFORE_TERMS, SEED_PUBLISHED, seed_scenario
from flashserve.plan.verdict import RACK_GPUS, verdict


def test_seed_scenario_reproduces_both_numbers() -> None:
    res = seed_scenario()
    for key in ("before", "after"):
        assert res[key].tokens_per_s_per_agent == pytest.approx(SEED_PUBLISHED[key], rel=0.05), key
    assert res["after"].capacity.sessions_fit >= res["after"].inputs.concurrency


def test_seed_differs_only_in_the_documented_software_terms() -> None:
    res = seed_scenario()
    before, after = res["before"].deployment, res["after"].deployment
    assert before.model is not None and before.gpus == after.gpus and before.draft_tokens == after.draft_tokens
    differing = {f.name for f in fields(Efficiency) if getattr(before.eff, f.name) != getattr(after.eff, f.name)}
    assert differing == set(SEED_BEFORE_TERMS) == {"layer_overhead_us"}
    assert before.eff.layer_overhead_us > after.eff.layer_overhead_us


@pytest.fixture(scope="module")
def v():
    return verdict()


def test_one_million_output_tokens_per_gpu_is_beyond_the_flop_ceiling(v) -> None:
    assert v.peak_output_tokens_per_s < 1e6  # even at 100% of peak
    assert v.best_output_tokens_per_s < v.peak_output_tokens_per_s
    assert v.best_output_tokens_per_s * RACK_GPUS >= 1e6  # per rack it is reachable


def test_what_would_have_to_be_true(v) -> None:
    assert v.required_for_price == pytest.approx(2.65e6 / (3600 * 0.002))
    assert 0.5 < v.hit_rate_for_tokens < 1.0  # counted cached prompt tokens at a high hit rate
    assert v.hit_rate_for_price <= v.hit_rate_for_tokens
    assert v.best.cost_per_million_output_tokens > 10 * 0.002  # output tokens alone are far from $0.002/M
    assert any("prefix-hit rate" in line for line in v.lines())
