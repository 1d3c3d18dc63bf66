"""The 2- and 3-bit expert widths the local ports run (llama.cpp Q2_K and Q3_K, a stated 3.0 bpw mix): their
bytes per weight, what a decode token reads from each tier at those widths, and that the dense weights stay
FP8 beside them. Every expected number is worked out by hand below, not read from the planner."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from flashserve.plan.capacity import capacity
from flashserve.plan.cli import main
from flashserve.plan.dtypes import WEIGHT_BYTES, dense_dtype_for
from flashserve.plan.inputs import PlanInputs
from flashserve.plan.planner import build_deployment, plan

# V4.1-Flash: 40 MoE layers, 384 routed experts of 3 x 5,120 x 2,304 = 35,389,440 weights, 6 selected per token.
# One decode token at concurrency 1 reads 40 x 6 x 35,389,440 = 8,493,465,600 routed weights (= 33,177,600 x 256).
# Per token, by width (bytes):
#   q2_k:   33,177,600 x 84  = 2,786,918,400
#   q3_k:   33,177,600 x 110 = 3,649,536,000
#   3.0bpw: 8,493,465,600 x 3 / 8 = 3,185,049,600
# Placement below: 16 of 384 per layer resident (1/24), 272 in host memory, 96 on disk (1/4). The host tier
# (CPU kernels) reads the host and the disk experts (23/24), the disk tier the disk experts (1/4).
EXPECTED = {  # width: (device, host tier, disk tier) bytes per decode step at concurrency 1
    "q2_k": (116_121_600, 2_670_796_800, 696_729_600),
    "q3_k": (152_064_000, 3_497_472_000, 912_384_000),
    "3.0bpw": (132_710_400, 3_052_339_200, 796_262_400),
}
HOST_GBS, DISK_GBS = 204.8, 5.0  # 8 channels x 8 B x 3,200 MT/s; a disk given on the command line
ETA_HOST = 0.85  # rtx-3090 uses the machine-prior profile: no eta_host_mem, so its eta_mem


def _inputs(width: str) -> PlanInputs:
    return PlanInputs(model="deepseek-v41-flash", hardware="rtx-3090", gpus=1, weight_dtype=width, concurrency=1,
                      resident_experts=16, host_experts=272,
                      hardware_overrides={"host_memory": 512, "host_bandwidth": HOST_GBS,
                                          "disk_bandwidth": DISK_GBS})


def test_bytes_per_weight_include_the_scales() -> None:
    assert WEIGHT_BYTES["q2_k"] == 84 / 256 == 2.625 / 8  # 64 B codes + 16 B scales/mins + 2 x fp16 per 256
    assert WEIGHT_BYTES["q3_k"] == 110 / 256 == 3.4375 / 8
    assert WEIGHT_BYTES["3.0bpw"] == 0.375
    for width in ("q2_k", "q3_k", "3.0bpw"):
        assert dense_dtype_for(width) == "fp8"


@pytest.mark.parametrize("width", sorted(EXPECTED))
def test_decode_token_reads_per_tier_at_2_and_3_bits(width: str) -> None:
    device, host, disk = EXPECTED[width]
    s = plan(_inputs(width)).step
    assert math.isclose(s.distinct_experts_per_layer, 6.0, rel_tol=1e-9)
    assert math.isclose(s.bytes_experts, device, rel_tol=1e-9)
    assert math.isclose(s.bytes_host_experts, host, rel_tol=1e-9)
    assert math.isclose(s.bytes_disk_experts, disk, rel_tol=1e-9)
    assert math.isclose(s.t_disk, disk / (DISK_GBS * 1e9), rel_tol=1e-9)
    assert math.isclose(s.t_host, host / (HOST_GBS * 1e9 * ETA_HOST), rel_tol=1e-9)


def test_dense_weights_and_kv_do_not_change_with_the_expert_width() -> None:
    base = plan(_inputs("fp4")).step
    for width in EXPECTED:
        s = plan(_inputs(width)).step
        assert s.bytes_dense == base.bytes_dense and s.bytes_kv == base.bytes_kv
        # experts shrink by the ratio of the widths: fp4 is MXFP4's 4.25 bits per weight
        ratio = {"q2_k": 2.625, "q3_k": 3.4375, "3.0bpw": 3.0}[width] / 4.25
        assert math.isclose(s.bytes_host_experts, base.bytes_host_experts * ratio, rel_tol=1e-9)


def test_narrower_experts_make_the_tiered_step_shorter() -> None:
    t = {w: plan(_inputs(w)).step.t_step for w in ("q2_k", "3.0bpw", "q3_k", "fp4")}
    assert t["q2_k"] < t["3.0bpw"] < t["q3_k"] < t["fp4"]


def test_whole_model_on_a_machine_at_q2_k() -> None:
    """Every expert in the unified memory: the fit check counts 543,581,798,400 routed weights x 84/256 bytes."""
    dep = build_deployment(PlanInputs(model="deepseek-v41-flash", hardware="apple-m3-ultra", gpus=1,
                                      weight_dtype="q2_k"))
    assert math.isclose(capacity(dep, 1536).routed_bytes_per_gpu, 178_362_777_600, rel_tol=1e-9)


def test_cli_takes_the_width_as_users_write_it(capsys) -> None:
    argv = ["--model", "deepseek-v41-flash", "--hardware", "rtx-3090", "--gpus", "1", "--host-memory", "512",
            "--host-bandwidth", "204.8", "--resident-experts", "16", "--json"]
    assert main([*argv, "--weight-dtype", "Q2_K"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weight_dtype"] == "q2_k" and data["dense_dtype"] == "fp8"
    assert main([*argv, "--weight-dtype", "q4_k"]) == 2
    err = capsys.readouterr().err
    assert "--weight-dtype" in err and "q2_k" in err and "q3_k" in err and "3.0bpw" in err


def test_fp4_plans_are_unchanged_by_the_new_widths() -> None:
    """The default width and its dense dtype are what they were (the datacenter points rest on them)."""
    assert WEIGHT_BYTES["fp4"] == 0.5 + 1 / 32 and dense_dtype_for("fp4") == "fp8"
    assert dense_dtype_for("bf16") == "bf16" and dense_dtype_for("fp8") == "fp8"
    r = plan(replace(_inputs("fp4"), resident_experts=None, host_experts=None, hardware="b200", gpus=8,
                     hardware_overrides={}))
    assert r.deployment.dense_dtype == "fp8" and r.deployment.expert_dtype == "fp4"
