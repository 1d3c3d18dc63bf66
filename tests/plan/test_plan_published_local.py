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
FIT = "ds4-m3-ultra-v41-q2"
HELD_OUT = {"local-hybrid": ["freetoken-5090-rome-v4flash-c1", "freetoken-5090-rome-v4flash-c8",
                             "vllm-3090-7443p-v41-c1", "vllm-3090-7443p-v41-c2", "vllm-3090-7443p-v41-c4"],
            "local-unified": ["ds4-strix-halo-v41-q2-ssd"]}


def test_every_local_point_loads_with_a_role_and_a_deployment_or_a_reason() -> None:
    assert len(PUBLISHED_LOCAL) == len({p.name for p in PUBLISHED_LOCAL}) == 14
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
            res = plan(p.inputs)
            assert not res.misfit(), (p.name, res.misfit())  # the deployment as published fits its machine


def test_fitted_and_held_out_points_are_the_documented_ones() -> None:
    """One point is fitted (the M3 Ultra sets the unified profile's eta_mem); the profiles list the points
    predicted with them, and each predicted point uses the profile its machine file names."""
    roles = {p.name: p.role for p in PUBLISHED_LOCAL}
    assert [n for n, r in roles.items() if r == "fit"] == [FIT]
    assert sorted(n for n, r in roles.items() if r == "held_out") == sorted(sum(HELD_OUT.values(), []))
    assert PROFILES["local-unified"]["fitted_on"] == [FIT] and PROFILES["local-hybrid"]["fitted_on"] == []
    for profile, names in HELD_OUT.items():
        assert PROFILES[profile]["held_out"] == names
        for name in names:
            assert ROWS[name]["profile"] == profile
    assert ROWS[FIT]["profile"] == "local-unified"
    for p in PUBLISHED_LOCAL:
        if p.inputs is not None:
            assert read_machine_file(p.inputs.hardware).efficiency == ROWS[p.name]["profile"]


def test_each_local_profile_differs_from_the_machine_prior_by_one_term() -> None:
    prior = PROFILES["machine-prior"]
    for name, term in (("local-hybrid", "eta_host_mem"), ("local-unified", "eta_mem")):
        local = PROFILES[name]
        assert set(local) - set(prior) <= {"eta_host_mem"}
        for t in prior:
            if t not in ("fitted_on", "held_out", term):
                assert local[t]["value"] == prior[t]["value"], (name, t)
    assert PROFILES["local-unified"]["eta_mem"]["value"] != prior["eta_mem"]["value"]


def test_stored_unified_term_is_the_documented_fit() -> None:
    """eta_mem of local-unified is the value (to 0.01) that puts the fitted point on its published speed."""
    p = next(p for p in PUBLISHED_LOCAL if p.name == FIT)
    assert p.inputs is not None
    stored = PROFILES["local-unified"]["eta_mem"]["value"]

    def decode(eta: float) -> float:
        res = plan(replace(p.inputs, overrides={"eta_mem": eta}))
        return res.accept_length / res.step.t_step

    assert decode(stored - 0.01) < p.decode < decode(stored + 0.01)
    assert abs(ROWS[FIT]["error"]) < 0.02  # type: ignore[arg-type]


def test_the_hybrid_points_time_the_cpu_by_their_measured_kernel_rate() -> None:
    """FreeToken's CPU expert kernel reads 110.3 GB/s (measured, `ft bench bw`); the 3090 host's CPU tier
    computes 3.5 experts of 13.3 MB in about 1 ms (its README): the host tier is their bytes at that rate, and
    the profile's eta_host_mem (the prior for machines without a rate) does not move it."""
    for name, rate in (("freetoken-5090-rome-v4flash-c1", 110.3e9), ("vllm-3090-7443p-v41-c1", 46.6e9)):
        p = next(p for p in PUBLISHED_LOCAL if p.name == name)
        assert p.inputs is not None
        for eta in (0.2, 0.9):
            s = plan(replace(p.inputs, overrides={"eta_host_mem": eta})).step
            assert s.bytes_host_experts > 0
            assert math.isclose(s.t_host, s.bytes_host_experts / rate, rel_tol=1e-9)
    assert math.isclose(3.5 * 190.5 * 2**30 / 15_360 / 1e-3, 46.6e9, rel_tol=0.01)  # the rate, from the README


def test_the_3090_points_read_the_misses_of_a_measured_hit_rate() -> None:
    """About 3.5 of a token's 6 experts per layer miss the VRAM cache: at concurrency 1 the host tier reads
    3.5 experts a layer at 3.0 bpw (V4.1: 40 layers, experts of 3 x 5,120 x 2,304 weights)."""
    p = next(p for p in PUBLISHED_LOCAL if p.name == "vllm-3090-7443p-v41-c1")
    assert p.inputs is not None and p.inputs.expert_hit_rate == pytest.approx(2.5 / 6)
    s = plan(p.inputs).step
    assert math.isclose(s.bytes_host_experts, 40 * 3.5 * 3 * 5120 * 2304 * 3.0 / 8, rel_tol=1e-9)


@pytest.mark.parametrize("name", [n for names in HELD_OUT.values() for n in names])
def test_held_out_local_point_within_the_bar(name: str) -> None:
    row = ROWS[name]
    assert abs(row["error"]) <= LOCAL_BAR, (  # type: ignore[arg-type]
        f"{name}: predicted {row['predicted']} vs published {row['published']} ({row['error']:+.1%})")


def test_bar_is_reported_as_computed() -> None:
    rows = list(ROWS.values())
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
    for r in ROWS.values():
        line = next(line for line in out.splitlines() if line.startswith(str(r["name"]) + " "))
        if r["error"] is None:
            assert "not predicted" in line
        else:
            assert f"({r['error']:+.0%})" in line
    bar = local_bar(list(ROWS.values()))
    verdict = "met" if bar["met"] else "not met"
    assert f"local bar (every held-out point within 30%, at least 4 held out): {verdict}" in out
    assert main(["published", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in data["local"]] == [p.name for p in PUBLISHED_LOCAL]
    assert data["local_bar"] == bar


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
WIDTHS = {"vllm-3090-7443p-v41-c1": "3.0bpw", "vllm-3090-7443p-v41-c2": "3.0bpw",
          "vllm-3090-7443p-v41-c4": "3.0bpw", "llamacpp-dgx-spark-v41-q2k": "q2_k",
          "ds4-m3-ultra-v41-q2": "iq2_xxs-q2_k", "ds4-strix-halo-v41-q2-ssd": "iq2_xxs-q2_k"}


def test_two_and_three_bit_points_carry_their_stated_width() -> None:
    points = {p.name: p for p in PUBLISHED_LOCAL}
    for name, width in WIDTHS.items():
        p = points[name]
        assert p.weight_dtype == width and ROWS[name]["weight_dtype"] == width
        assert p.weight_dtype_basis.startswith("stated: ")
        if p.inputs is not None:
            assert p.inputs.weight_dtype == width
    assert points["freetoken-5090-rome-v4flash-c1"].weight_dtype == "fp4"


def test_the_ds4_points_fit_only_with_the_tables_on_disk() -> None:
    """ds4 keeps the engram tables (196.6 B FP8 weights x 1.03125 bytes with scales = 202.8 GB) on disk: in
    the M3 Ultra's unified memory beside its experts they would not fit; the Strix Halo streams the experts
    beyond its 88.88 GB cache from its RAID, read at the 13.5 GB/s its report measures."""
    m3 = next(p for p in PUBLISHED_LOCAL if p.name == FIT)
    assert m3.inputs is not None and m3.inputs.engram_tables == "disk"
    in_memory = replace(m3.inputs, engram_tables=None)
    dep = build_deployment(in_memory)
    cap = capacity(dep, in_memory.resolved_context())
    assert math.isclose(cap.host_table_bytes_in_device, 196_608_000_000 * 1.03125, rel_tol=2e-3)
    assert misfit_reasons(dep, cap, 1, in_memory.resolved_context())
    assert speed_gaps(build_deployment(replace(m3.inputs, memory_bound_only=False)))  # Apple: no FLOP/s
    strix = next(p for p in PUBLISHED_LOCAL if p.name == "ds4-strix-halo-v41-q2-ssd")
    assert strix.inputs is not None and strix.inputs.resident_experts == 223  # 88.88 GB / (152.9 GB / 384)
    s = plan(strix.inputs).step
    assert s.bytes_disk_experts > 0 and read_machine_file(strix.inputs.hardware).disk_read_gbs == 13.5
    # the experts' misses and the engram rows (bytes only: no IOPS stated) both read at the RAID's bandwidth
    assert math.isclose(s.t_disk - s.t_disk_tables, s.bytes_disk_experts / 13.5e9, rel_tol=1e-9)
    assert 0 < s.t_disk_tables < 1e-5


def test_the_3090_deployment_fits_with_the_experts_in_host_memory() -> None:
    """At 3.0 bpw V4.1's 543,581,798,400 routed weights are 203,843,174,400 bytes: beyond one RTX 3090, so
    the report keeps them in its 503 GiB of host memory (with the engram tables) and about 10 a layer on the
    GPU."""
    inp = PlanInputs(model="deepseek-v41-flash", hardware="rtx-3090", gpus=1, weight_dtype="3.0bpw", concurrency=1)
    dep = build_deployment(inp)
    cap = capacity(dep, inp.resolved_context())
    assert math.isclose(cap.routed_bytes_per_gpu, 203_843_174_400, rel_tol=1e-9)
    assert misfit_reasons(dep, cap, 1, inp.resolved_context())
    p = next(p for p in PUBLISHED_LOCAL if p.name == "vllm-3090-7443p-v41-c4")
    assert p.inputs is not None and not plan(p.inputs).misfit()
    with pytest.raises(PlanError, match="no memory size"):  # the EPYC preset: its RAM depends on the DIMMs
        build_deployment(replace(inp, hardware="epyc-ddr4-8ch"))
