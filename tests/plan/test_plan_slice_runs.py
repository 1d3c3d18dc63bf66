"""The planner against the engine's own real-size runs on a 2-core machine (data/slice_runs: the machine measured by
``scripts/plan_slices.py machine``, three ``scripts/bench_slice.py --json`` runs of V4.1-Flash slices, eager):
calibrated on the one-layer slice's two batch sizes, it predicts the two-layer slice and the two-layer slice under
an 11 GiB weight budget (experts streamed from disk) within 25%, issue 53's bar for the engine's slice runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashserve.plan.engine_runs import check_runs, run_points

DATA = Path(__file__).parent / "data" / "slice_runs"
RUNS = (("v41-1", "v41-1"), ("v41-2", "v41-2"), ("v41-2-budget", "v41-2"))  # run, its slice's config


def _runs() -> list:
    machine = str(DATA / "machine.json")
    return [(name, run_points(json.loads((DATA / f"{name}.json").read_text()), machine,
                              str(DATA / f"{config}.config.json"))) for name, config in RUNS]


def test_one_calibrated_run_predicts_the_other_slice_runs_within_a_quarter() -> None:
    fitted, rows = check_runs(_runs(), str(DATA / "machine.json"))
    assert [(r.run, r.batch, r.fitted) for r in rows] == [
        ("v41-1", 1, True), ("v41-1", 16, True), ("v41-2", 1, False), ("v41-2", 16, False),
        ("v41-2-budget", 1, False), ("v41-2-budget", 4, False)]
    assert all(abs(r.error) < 0.02 for r in rows if r.fitted)  # two terms, two points
    assert 0.3 < fitted["eta_mem"] < 1 and 0.3 < fitted["eta_flop"] < 1
    held = {(r.run, r.batch): r.error for r in rows if not r.fitted}
    assert max(map(abs, held.values())) < 0.25, held


def test_the_budget_run_is_planned_with_its_cache_and_disk() -> None:
    """The streamed run's points carry the experts its cache held, the hit rate each batch measured and the disk
    bandwidth the run measured; the resident runs have no placement."""
    runs = dict(_runs())
    budget = json.loads((DATA / "v41-2-budget.json").read_text())
    for point, row in zip(runs["v41-2-budget"], budget["rows"]):
        assert point.inputs.resident_experts == budget["experts_held_per_layer"] < 384
        assert point.inputs.expert_hit_rate == row["expert_hit_rate"]
        assert point.inputs.hardware_overrides == {"disk_bandwidth": budget["disk_read_GB_s"]}
        assert point.decode_only and point.tokens_per_s_per_agent == pytest.approx(row["tok_s"] / row["batch"])
    assert all(p.inputs.resident_experts is None for p in runs["v41-2"])
