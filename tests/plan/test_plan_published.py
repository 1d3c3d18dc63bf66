"""Published measurements: held-out points within ±25%, and the stored profiles are what the documented fits give."""

from __future__ import annotations

import json

import pytest

from flashserve.plan.calibrate import Measured, fit
from flashserve.plan.hardware import HARDWARE_JSON, load_catalog
from flashserve.plan.scenarios import PUBLISHED, PUBLISHED_LOCAL
from flashserve.plan.validation import compare_published

ROWS = {r["name"]: r for r in compare_published()}


@pytest.mark.parametrize("name", [p.name for p in PUBLISHED if p.role == "held_out"])
def test_held_out_points_within_25_percent(name: str) -> None:
    row = ROWS[name]
    assert abs(row["agent_error"]) <= 0.25, row
    if row["gpu_error"] is not None:
        assert abs(row["gpu_error"]) <= 0.25, row


def test_required_points_are_all_checked() -> None:
    published = {(p.inputs.hardware, p.tokens_per_s_per_agent) for p in PUBLISHED}
    for point in [("b200", 111.0), ("b200", 368.0), ("h800", 20.0), ("gb300-nvl72", 71.0),
                  ("gb300-nvl72", 128.0), ("gb300-nvl72", 184.0)]:
        assert point in published
    # every hardware type with published points keeps at least one of them out of its fit
    for hw in {p.inputs.hardware for p in PUBLISHED}:
        profile = load_catalog()[hw].efficiency.name
        same = [p for p in PUBLISHED if load_catalog()[p.inputs.hardware].efficiency.name == profile]
        assert any(p.role == "held_out" for p in same)


def test_profiles_document_their_fit_and_held_out_points() -> None:
    data = json.loads(HARDWARE_JSON.read_text())
    names = {p.name: p for p in (*PUBLISHED, *PUBLISHED_LOCAL)}
    for profile, entry in data["efficiency"].items():
        for name in entry["fitted_on"]:
            assert names[name].role == "fit"
        for name in entry["held_out"]:
            assert names[name].role == "held_out"
        assert not set(entry["fitted_on"]) & set(entry["held_out"])


PRIORS = {"eta_flop": 0.5, "layer_overhead_us": 100.0, "eta_comm": 0.8}


@pytest.mark.parametrize("profile,hardware,terms", [
    ("b200", "b200", ["layer_overhead_us"]),
    ("hopper", "h100", ["eta_comm"]),
    ("gb300-nvl72", "gb300-nvl72", ["layer_overhead_us", "eta_flop"]),
])
def test_stored_profile_is_the_documented_fit(profile: str, hardware: str, terms: list[str]) -> None:
    fitted_on = json.loads(HARDWARE_JSON.read_text())["efficiency"][profile]["fitted_on"]
    points = [Measured(p.inputs, p.tokens_per_s_per_agent) for p in PUBLISHED if p.name in fitted_on]
    assert points
    start = {t: PRIORS[t] for t in terms}
    values = fit(points, terms, start, rounds=6)
    stored = load_catalog()[hardware].efficiency
    for t in terms:
        assert values[t] == pytest.approx(getattr(stored, t), rel=0.03), t
