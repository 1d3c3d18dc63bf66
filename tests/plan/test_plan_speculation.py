"""What a DSpark step costs: the fixed per-step term, its fit on a with/without pair, the held-out pairs, the
split of the speculative step, the concurrency where drafting stops paying, and both curves in the output.

Expected values come from the published figures by hand: TPOT 2.19 ms at acceptance length 3.51 is a
7.687 ms step (InferenceX PR 3176); SGLang's 2.08x at acceptance length 3.4 means a DSpark step costs
3.4 / 2.08 = 1.635 plain steps (sglang PR 29538, issue 29488)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flashserve.plan.cli import main
from flashserve.plan.planner import plan
from flashserve.plan.roofline import decode_step
from flashserve.plan.scenarios import PUBLISHED, PUBLISHED_SPEEDUP
from flashserve.plan.stacks import load_stacks
from flashserve.plan.validation import compare_published_speedups

TOLERANCE = 0.25  # docs/plan.md: held-out points within 25%
ROWS = {r["name"]: r for r in compare_published_speedups()}
PAIRS = {p.name: p for p in PUBLISHED_SPEEDUP}
STACK = load_stacks()["v41-vllm-sglang-2026-09"]
PREVIOUS_STACK = {"layer_overhead_us": 148.0, "spec_step_overhead_us": 0.0}  # 148 µs/layer fitted on GB300 alone


@pytest.mark.parametrize("name", [p.name for p in PUBLISHED_SPEEDUP if p.role == "held_out"])
def test_held_out_speedups_within_tolerance(name: str) -> None:
    row = ROWS[name]
    assert abs(row["speedup_error"]) <= TOLERANCE, (
        f"{name}: predicted {row['predicted_speedup']:.2f}x vs published {row['published_speedup']:.2f}x "
        f"({row['speedup_error']:+.1%})")


@pytest.mark.parametrize("name", [p.name for p in PUBLISHED_SPEEDUP if p.role == "held_out"])
def test_without_the_fixed_term_the_held_out_speedups_miss(name: str) -> None:
    """The previous stack (all fixed time per layer, none per step) makes a plain step nearly as slow per layer
    as a DSpark step, so drafting looks about 3x: every held-out pair leaves the tolerance."""
    p = PAIRS[name]
    before = plan(replace(p.inputs, overrides=PREVIOUS_STACK)).speculation.speedup
    assert before / p.speedup - 1 > TOLERANCE


def test_the_two_fitted_points_are_reproduced_by_hand() -> None:
    fit_pair = [p for p in PUBLISHED_SPEEDUP if p.role == "fit"]
    assert [p.name for p in fit_pair] == ["b200-dspark-speedup-random-c1"]
    spec = plan(fit_pair[0].inputs).speculation
    assert spec.step_with_s / spec.step_without_s == pytest.approx(3.4 / 2.08, rel=0.005)
    gb300 = next(p for p in PUBLISHED if p.name == "gb300-v41-dspark-vllm-c1")
    assert plan(gb300.inputs).step.t_step == pytest.approx(3.51 * 2.19e-3, rel=0.005)
    assert set(STACK.fitted_on) == {"gb300-v41-dspark-vllm-c1", "b200-dspark-speedup-random-c1"}
    assert {n for n in STACK.held_out if n in PAIRS} == {p.name for p in PUBLISHED_SPEEDUP if p.role == "held_out"}


def test_not_reproduced_pairs_are_what_the_docs_say() -> None:
    """At 32 agents SGLang's speed-up fell to 1.28x / 1.35x; the planner's falls (1.8x) but not that far.
    docs/plan.md reports this miss; if a change fixes it, move the points to held_out and update the docs."""
    for name in ("b200-dspark-speedup-random-c32", "b200-dspark-speedup-sharegpt-c32"):
        row = ROWS[name]
        assert PAIRS[name].role == "not_reproduced"
        c1 = ROWS[name.replace("c32", "c1")]
        assert row["predicted_speedup"] < c1["predicted_speedup"]  # falls with concurrency
        assert row["speedup_error"] > TOLERANCE


def test_speculative_step_is_the_plain_step_plus_its_three_parts() -> None:
    p = PAIRS["b200-dspark-speedup-single-1k"]
    res = plan(p.inputs)
    s = res.speculation
    assert s.fixed_s == pytest.approx(STACK.terms["spec_step_overhead_us"] * 1e-6)
    assert s.draft_stages_s > 0 and s.verification_rows_s > 0
    assert s.step_without_s + s.verification_rows_s + s.draft_stages_s + s.fixed_s == pytest.approx(s.step_with_s)
    assert res.step.t_step == pytest.approx(s.step_with_s)
    # no drafting: no fixed speculative cost and nothing to compare
    plain = plan(replace(p.inputs, accept_length=1.0, draft_tokens=0))
    assert plain.speculation is None and plain.step.t_spec_fixed == 0.0
    assert plain.step.t_step == pytest.approx(s.step_without_s)
    # the fixed term is paid once per step: the same at 1 and at 64 sequences
    many = plan(replace(p.inputs, concurrency=64)).speculation
    assert many.fixed_s == s.fixed_s


def test_drafting_stops_paying_at_the_reported_crossover() -> None:
    p = PAIRS["b200-dspark-speedup-random-c1"]
    res = plan(p.inputs)
    dep, ctx, al = res.deployment, res.context, res.accept_length
    c = res.speculation.crossover_concurrency
    assert c is not None and 1 < c <= res.capacity.sessions_fit

    def speedup(n: int) -> float:
        return al * decode_step(replace(dep, draft_tokens=0), n, ctx).t_step / decode_step(dep, n, ctx).t_step

    assert speedup(c) <= 1.0 < speedup(c - 1)
    assert speedup(1) == pytest.approx(res.speculation.speedup)


def test_crossover_is_searched_only_over_sessions_that_fit() -> None:
    p = PAIRS["b200-dspark-speedup-random-c1"]
    res = plan(replace(p.inputs, context=1_000_000, prompt_len=1_000_000))  # few sessions fit at 1M
    s = res.speculation
    assert s.checked_up_to == res.capacity.sessions_fit
    assert s.crossover_concurrency is None or s.crossover_concurrency <= res.capacity.sessions_fit


V41_GB300 = ["--model", "deepseek-v41-flash", "--hardware", "gb300-nvl72", "--gpus", "4", "--tp", "4", "--ep", "1",
             "--accept-length", "3.51", "--draft-tokens", "5"]


def test_plan_prints_both_speeds_and_the_crossover(capsys) -> None:
    assert main(V41_GB300) == 0
    out = capsys.readouterr().out
    assert "without drafting" in out and "drafting stops paying" in out
    assert main(V41_GB300 + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    s = d["speculation"]
    assert s["speedup"] == pytest.approx(3.51 * s["step_without_ms"] / s["step_with_ms"])
    assert s["fixed_ms"] == pytest.approx(STACK.terms["spec_step_overhead_us"] / 1e3)
    assert s["crossover_concurrency"] and s["crossover_concurrency"] <= d["sessions_fit"]
    assert main(V41_GB300 + ["--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    text = " ".join(" ".join(lines).split())
    for term in ("[speculation]", "+ verification rows", "of which KV gathered per row", "+ draft stages",
                 "+ fixed per step",
                 "drafting stops paying", "spec_step_overhead_us"):
        assert term in text


def test_no_drafter_no_speculation_section(capsys) -> None:
    assert main(["--model", "deepseek-r1", "--hardware", "b200", "--gpus", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speculation"] is None


def test_sweep_draws_both_curves(tmp_path, capsys) -> None:
    argv = V41_GB300 + ["sweep", "--levels", "1,64", "--out", str(tmp_path / "s"), "--json"]
    assert main(argv) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["speculation_crossover_concurrency"]
    for p in points:
        ratio = p["tokens_per_s_per_agent"] / p["tokens_per_s_per_agent_without_speculation"]
        assert ratio == pytest.approx(p["output_tokens_per_s_per_gpu"] / p["output_tokens_per_s_per_gpu_without_speculation"])
        assert ratio > 1.0  # drafting still pays at 1 and 64 agents on this deployment
    assert (tmp_path / "s.png").stat().st_size > 0
