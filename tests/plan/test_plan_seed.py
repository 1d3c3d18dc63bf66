"""The seed's headline (596 → 848 tokens/s per agent) checked with the measured stack, and the verdict on its
aggregate claims."""

from __future__ import annotations

from dataclasses import fields

import pytest

from flashserve.plan.hardware import Efficiency
from flashserve.plan.cli import main
from flashserve.plan.seed import SEED_PUBLISHED, SOLVED_TERM, seed_scenario
from flashserve.plan.stacks import load_stacks
from flashserve.plan.verdict import RACK_GPUS, verdict


@pytest.fixture(scope="module")
def seed():
    return seed_scenario()


def test_seed_with_the_measured_stack_falls_well_short_of_the_headline(seed) -> None:
    """docs/plan.md §4: with the measured V4.1 stack (the default) the planner does not reproduce 596 or 848;
    both are further off than the 25% the held-out points are held to."""
    m = seed["measured"]
    stack = load_stacks()["v41-vllm-sglang-2026-09"]
    assert m.deployment.stack == stack.name
    assert m.deployment.eff.layer_overhead_us == stack.terms["layer_overhead_us"]
    for key in ("before", "after"):
        assert m.tokens_per_s_per_agent < 0.75 * SEED_PUBLISHED[key], key


def test_what_would_have_to_be_true_hits_both_published_numbers(seed) -> None:
    for key in ("before", "after"):
        assert seed[key].tokens_per_s_per_agent == pytest.approx(SEED_PUBLISHED[key], rel=1e-3), key
    assert seed["after"].capacity.sessions_fit >= seed["after"].inputs.concurrency
    # the one-month figure needs less than half the fixed time per layer of the measured stacks
    assert seed["after"].deployment.eff.layer_overhead_us < seed["measured"].deployment.eff.layer_overhead_us / 2


def test_seed_differs_only_in_the_solved_software_term(seed) -> None:
    before, after = seed["before"].deployment, seed["after"].deployment
    assert before.gpus == after.gpus and before.draft_tokens == after.draft_tokens
    differing = {f.name for f in fields(Efficiency) if getattr(before.eff, f.name) != getattr(after.eff, f.name)}
    assert differing == {SOLVED_TERM} == {"layer_overhead_us"}
    assert before.eff.layer_overhead_us > after.eff.layer_overhead_us


def test_seed_command_says_the_headline_is_not_reproduced(capsys) -> None:
    assert main(["seed"]) == 0
    out = capsys.readouterr().out
    assert "measured stack v41-vllm-sglang-2026-09" in out and "not reproduced" in out
    assert "what would have to be true" in out


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
