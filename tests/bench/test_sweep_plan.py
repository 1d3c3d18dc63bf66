"""The planner's curve beside a measured sweep: the same setup as measured (acceptance length, TP/EP, stack),
and no predicted point for a deployment that does not fit."""

from __future__ import annotations

import pytest

from flashserve.bench.chart import _notes, _xy
from flashserve.bench.serve import ServeConfig
from flashserve.bench.sweep import PlanSetup, measured_accept_length, predicted_curve

CFG = ServeConfig(base_url="http://127.0.0.1:9", num_devices=4)
V41_GB300 = PlanSetup("gb300-nvl72", "deepseek-v41-flash", "fp4", gpus=4, tp=4, ep=1, draft_tokens=5)
PUBLISHED_C1 = 1000.0 / 2.19  # InferenceX PR 3176: vLLM 4xGB300 TP4/EP1, DSpark AL 3.51, TPOT 2.19 ms


def test_measured_acceptance_length_pools_every_level() -> None:
    results = [{"spec_decode_num_drafts": 100, "spec_decode_accepted_tokens": 200},
               {"spec_decode_num_drafts": 300, "spec_decode_accepted_tokens": 300}, {}]
    assert measured_accept_length(results) == pytest.approx(1 + 500 / 400)
    assert measured_accept_length([{}, {}]) is None


def test_planner_curve_uses_the_measured_acceptance_length_and_layout() -> None:
    """With the server's acceptance length the planner lands on the published one-agent point; without
    speculation (AL 1) it predicts a slower agent."""
    spec = predicted_curve(V41_GB300, CFG, [1], 1024, 1024, measured_al=3.51)
    plain = predicted_curve(V41_GB300, CFG, [1], 1024, 1024, measured_al=None)
    agent = spec["predicted"][0]["tokens_per_s_per_agent"]
    assert abs(agent / PUBLISHED_C1 - 1) < 0.25
    assert plain["predicted"][0]["tokens_per_s_per_agent"] < agent / 2
    assert "TP4 EP1" in spec["predicted_note"] and "stack v41-vllm-sglang-2026-09" in spec["predicted_note"]
    assert "acceptance length 3.51 (measured by the server)" in spec["predicted_note"]
    assert "acceptance length 1 (no speculation reported)" in plain["predicted_note"]


def test_plan_flags_override_the_measured_setup() -> None:
    from dataclasses import replace

    forced = predicted_curve(replace(V41_GB300, accept_length=2.0, stack="none"), CFG, [1], 1024, 1024, 3.51)
    assert "acceptance length 2 (--plan-accept-length)" in forced["predicted_note"]
    assert "stack none" in forced["predicted_note"]


def test_levels_that_do_not_fit_get_no_predicted_point_and_are_named() -> None:
    setup = PlanSetup("gb300-nvl72", "deepseek-v41-flash", "fp4", gpus=4, tp=4, ep=1)
    pred = predicted_curve(setup, CFG, [1, 10_000_000], 65536, 1024)
    assert [p["concurrency"] for p in pred["predicted"]] == [1]
    assert [m["concurrency"] for m in pred["predicted_misfits"]] == [10_000_000]
    assert "fit in HBM" in pred["predicted_misfits"][0]["reasons"][0]
    assert "left out (does not fit): c=10000000" in pred["predicted_note"]
    summary = {"configurations": {"ours": {"measured": [], **pred}}}
    assert _notes(summary) == ["ours: planner points left out, deployment does not fit at c=10000000"]


def test_chart_drops_planner_points_marked_as_misfit() -> None:
    points = [{"concurrency": 1, "tokens_per_s_per_agent": 10.0, "output_tokens_per_s_per_gpu": 10.0, "fits": True},
              {"concurrency": 8, "tokens_per_s_per_agent": 5.0, "output_tokens_per_s_per_gpu": 40.0, "fits": False},
              {"concurrency": 2, "tokens_per_s_per_agent": 8.0, "output_tokens_per_s_per_gpu": 16.0}]
    assert _xy(points) == ([10.0, 8.0], [10.0, 16.0])
    assert _notes({"configurations": {"old": {"measured": [], "predicted": points}}}) == [
        "old: planner points left out, deployment does not fit at c=8"]


def test_a_planner_error_leaves_the_curve_out_with_the_reason() -> None:
    pred = predicted_curve(PlanSetup("no-such-gpu", "deepseek-v41-flash"), CFG, [1], 128, 64)
    assert pred["predicted"] is None and pred["predicted_note"].startswith("planner curve left out:")


def test_plan_flags_without_a_planner_target_are_refused(tmp_path, capsys) -> None:
    from flashserve.cli import main

    assert main(["bench", "sweep", "--base-url", "http://127.0.0.1:9", "--tokenizer", "tiny-v41",
                 "--concurrency", "1", "--out", str(tmp_path), "--plan-tp", "4", "--plan-stack", "none"]) == 2
    assert "--plan-tp, --plan-stack need --plan-hardware" in capsys.readouterr().err


def _level(completed: int, prompt: float, output: float) -> dict:
    return {"completed": completed, "input_len_stats": {"mean": prompt}, "output_len_stats": {"mean": output},
            "tokens_per_s_per_agent": 10.0 if completed else None, "output_tokens_per_s_per_device": 10.0 * completed,
            "cost_per_million_output_tokens": None, "median_tpot_ms": 100.0, "median_ttft_ms": 50.0}


def test_levels_that_complete_nothing_are_left_out_of_curve_and_averages() -> None:
    from flashserve.bench.sweep import sweep_entry

    setup = PlanSetup("cpu-local", "tiny-v41")
    entry = sweep_entry(CFG, setup, [1, 2, 4], [_level(4, 100, 30), _level(0, 7, 0), _level(4, 120, 50)])
    assert entry["failed_levels"] == [2]
    assert [p["concurrency"] for p in entry["measured"]] == [1, 4]
    assert (entry["input_len"], entry["output_len"]) == (110, 40)  # the failed level's 7 / 0 not averaged in
    none = sweep_entry(CFG, setup, [1], [_level(0, 7, 0)])
    assert none["measured"] == [] and none["predicted"] is None and none["input_len"] is None
    assert none["predicted_note"] == "planner curve left out: no level completed a request"
