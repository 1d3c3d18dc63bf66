"""The local points of reference figures §7 in ``plan published``: each loads with its deployment as published,
carries its role (fit, held out, not predicted with a reason), the one host-tier term fitted on them is what the
stored profile holds, the local bar is reported as computed, and the datacenter profiles and
their predictions do not see the new term."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from flashserve.plan.capacity import capacity
from flashserve.plan.cli import main
from flashserve.plan.errors import PlanError
from flashserve.plan.hardware import HARDWARE_JSON, load_catalog
from flashserve.plan.inputs import PlanInputs
from flashserve.plan.machine import read_machine_file
from flashserve.plan.planner import build_deployment, misfit_reasons, plan, speed_gaps
from flashserve.plan.scenarios import PUBLISHED, PUBLISHED_LOCAL
from flashserve.plan.validation import (
    LOCAL_BAR,
    compare_published,
    compare_published_local,
    local_bar,
)

ROWS = {r["name"]: r for r in compare_published_local()}
PROFILES = json.loads(HARDWARE_JSON.read_text())["efficiency"]
FIT = "freetoken-5090-rome-v4flash-c1"


def test_every_local_point_loads_with_a_role_and_a_deployment_or_a_reason() -> None:
    assert len(PUBLISHED_LOCAL) == len({p.name for p in PUBLISHED_LOCAL}) == 13
    assert not {p.name for p in PUBLISHED_LOCAL} & {p.name for p in PUBLISHED}
    for p in PUBLISHED_LOCAL:
        assert p.role in ("fit", "held_out", "not_predicted"), p
        assert p.source.startswith("docs/reference-figures.md §7") and p.decode > 0 and p.concurrency >= 1
        if p.role == "not_predicted":
            assert p.inputs is None and p.assumptions  # the reason
            assert ROWS[p.name]["predicted_decode"] is None and ROWS[p.name]["error"] is None
        else:
            assert p.inputs is not None
            assert Path(p.inputs.hardware).is_file()
            assert math.isfinite(ROWS[p.name]["predicted_decode"])  # type: ignore[arg-type]


def test_fitted_and_held_out_points_are_the_documented_ones() -> None:
    roles = {p.name: p.role for p in PUBLISHED_LOCAL}
    assert [n for n, r in roles.items() if r == "fit"] == [FIT]
    assert [n for n, r in roles.items() if r == "held_out"] == ["freetoken-5090-rome-v4flash-c8"]
    prof = PROFILES["local-hybrid"]
    assert prof["fitted_on"] == [FIT] and prof["held_out"] == ["freetoken-5090-rome-v4flash-c8"]
    for p in PUBLISHED_LOCAL:
        if p.inputs is not None:
            assert ROWS[p.name]["profile"] == "local-hybrid"
            assert read_machine_file(p.inputs.hardware).efficiency == "local-hybrid"


def test_only_the_host_term_is_fitted_and_the_rest_is_the_machine_prior() -> None:
    local, prior = PROFILES["local-hybrid"], PROFILES["machine-prior"]
    assert set(local) - set(prior) == {"eta_host_mem"}
    for term in prior:
        if term not in ("fitted_on", "held_out"):
            assert local[term]["value"] == prior[term]["value"], term


def test_stored_host_term_is_the_documented_fit() -> None:
    """eta_host_mem is the value (to 0.01) that puts the fitted point on its published decode speed."""
    p = next(p for p in PUBLISHED_LOCAL if p.name == FIT)
    assert p.inputs is not None
    stored = PROFILES["local-hybrid"]["eta_host_mem"]["value"]

    def decode(eta: float) -> float:
        res = plan(replace(p.inputs, overrides={"eta_host_mem": eta}))
        return res.accept_length / res.step.t_step

    assert decode(stored - 0.01) < p.decode < decode(stored + 0.01)
    assert abs(ROWS[FIT]["error"]) < 0.02  # type: ignore[arg-type]


def test_host_tier_time_uses_the_host_term() -> None:
    """Hand-computed: the CPU tier's time is its bytes / (8 channels x 8 B x 3,200 MT/s x eta_host_mem)."""
    p = next(p for p in PUBLISHED_LOCAL if p.name == FIT)
    assert p.inputs is not None
    for eta in (0.4, 0.7):
        s = plan(replace(p.inputs, overrides={"eta_host_mem": eta})).step
        assert s.bytes_host_experts > 0
        assert math.isclose(s.t_host, s.bytes_host_experts / (8 * 8 * 3200e6 * eta), rel_tol=1e-9)


def test_bar_is_reported_as_computed() -> None:
    rows = compare_published_local()
    bar = local_bar(rows)
    held = [r for r in rows if r["role"] == "held_out"]
    assert bar["held_out"] == len(held) and bar["fitted"] == 1
    assert bar["not_predicted"] == len(rows) - len(held) - 1
    worst = max(abs(r["error"]) for r in held)  # type: ignore[arg-type]
    assert bar["worst_held_out_error"] == worst
    assert bar["met"] == (len(held) >= 4 and worst <= LOCAL_BAR)


def test_plan_published_prints_every_local_point_and_the_bar(capsys) -> None:
    assert main(["published"]) == 0
    out = capsys.readouterr().out
    for r in compare_published_local():
        line = next(line for line in out.splitlines() if line.startswith(str(r["name"]) + " "))
        if r["error"] is None:
            assert "not predicted" in line
        else:
            assert f"({r['error']:+.0%})" in line
    verdict = "met" if local_bar(compare_published_local())["met"] else "not met"
    assert f"local bar (every held-out point within 30%, at least 4 held out): {verdict}" in out
    assert main(["published", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in data["local"]] == [p.name for p in PUBLISHED_LOCAL]
    assert data["local_bar"] == local_bar(compare_published_local())


def test_datacenter_profiles_and_predictions_do_not_see_the_host_term() -> None:
    for name, prof in PROFILES.items():
        if name != "local-hybrid":
            assert "eta_host_mem" not in prof, name
    for hw in load_catalog().values():
        assert hw.efficiency.eta_host_mem is None
        assert hw.efficiency.host_mem_efficiency == hw.efficiency.eta_mem
    for p, row in zip(PUBLISHED, compare_published()):
        res = plan(replace(p.inputs, overrides={**p.inputs.overrides, "eta_host_mem": 0.123}))
        assert res.tokens_per_s_per_agent == row["predicted_agent"] or (
            p.agent_metric == "step" and math.isclose(res.accept_length / res.step.t_step, row["predicted_agent"]))


# the points whose quantization is a 2- or 3-bit expert width, and the width the planner reads it as
WIDTHS = {"vllm-3090-7443p-v41-c1": "3.0bpw", "vllm-3090-7443p-v41-c4": "3.0bpw",
          "llamacpp-dgx-spark-v41-q2k": "q2_k", "ds4-m3-ultra-v41-q2": "q2_k", "ds4-strix-halo-v41-q2-ssd": "q2_k"}


def test_two_and_three_bit_points_carry_their_width_and_say_when_it_is_assumed() -> None:
    points = {p.name: p for p in PUBLISHED_LOCAL}
    for name, width in WIDTHS.items():
        p = points[name]
        assert p.weight_dtype == width and ROWS[name]["weight_dtype"] == width
        assert "no 2-bit" not in p.assumptions and "no 3-bit" not in p.assumptions
        if "Q2," in p.setup or p.setup.endswith("Q2"):  # ds4 states only "Q2": the width is an assumption
            assert p.weight_dtype_basis.startswith("assumption: ") and "2.625 bits per weight" in p.weight_dtype_basis
            assert p.assumptions.startswith("assumption: ") and "Q2_K" in p.assumptions
        else:
            assert p.weight_dtype_basis.startswith("stated: ")
    assert points[FIT].weight_dtype == "fp4"


def test_reasons_of_the_two_bit_points_are_what_the_planner_finds() -> None:
    """Planned at their width on the machine presets, the ds4 and DGX Spark points fail where their reasons
    say: the engram tables (196.6 B FP8 weights x 1.03125 bytes with scales = 202.8 GB) counted in the unified memory beside 178.4 GB
    of Q2_K experts, no FLOP/s for the FP8 or widened 2-bit GEMMs, no disk bandwidth."""
    for hw, name in (("apple-m3-ultra", "ds4-m3-ultra-v41-q2"), ("strix-halo", "ds4-strix-halo-v41-q2-ssd"),
                     ("dgx-spark", "llamacpp-dgx-spark-v41-q2k")):
        inp = PlanInputs(model="deepseek-v41-flash", hardware=hw, gpus=1, weight_dtype="q2_k", concurrency=1)
        dep = build_deployment(inp)
        cap = capacity(dep, inp.resolved_context())
        assert math.isclose(cap.host_table_bytes_in_device, 196_608_000_000 * 1.03125, rel_tol=2e-3)
        assert misfit_reasons(dep, cap, 1, inp.resolved_context())
        assert speed_gaps(dep) and "FLOP/s" in speed_gaps(dep)[0]
        assert dep.hw.machine is not None and dep.hw.machine.disk_read_gbs is None
        assert "disk.read_gbs" in dep.hw.machine.not_published
        assert "178.4 GB" in next(p for p in PUBLISHED_LOCAL if p.name == name).assumptions


def test_reason_of_the_three_bit_points_is_what_the_planner_finds() -> None:
    """At 3.0 bpw V4.1's 543,581,798,400 routed weights are 203,843,174,400 bytes: beyond one RTX 3090, and the
    EPYC 7443P preset leaves the host memory out, so the off-GPU tiers cannot be sized."""
    inp = PlanInputs(model="deepseek-v41-flash", hardware="rtx-3090", gpus=1, weight_dtype="3.0bpw", concurrency=1)
    dep = build_deployment(inp)
    cap = capacity(dep, inp.resolved_context())
    assert math.isclose(cap.routed_bytes_per_gpu, 203_843_174_400, rel_tol=1e-9)
    assert misfit_reasons(dep, cap, 1, inp.resolved_context())
    with pytest.raises(PlanError, match="no memory size"):  # the host of the report: its RAM is not stated
        build_deployment(replace(inp, hardware="epyc-ddr4-8ch"))
    assert "203.8 GB" in next(p for p in PUBLISHED_LOCAL if p.name == "vllm-3090-7443p-v41-c1").assumptions
