"""Routed experts placed across a machine's tiers (GPU memory, host memory, disk): the bytes and time of each
tier for one decode step, recomputed here by hand from the model's terms and the machine's figures; what fits
where and what the refusal tells the user to move; the placement flags refused with exit status 2."""

from __future__ import annotations

import json
import math

import pytest

from flashserve.plan.cli import main
from flashserve.plan.hardware import HARDWARE_JSON
from flashserve.plan.models import resolve_model
from tier_box import BOX, CTX, ETA_COMM, ETA_FLOP, ETA_MEM, FP4, LAYER_US, MODEL, TERMS, plan_json, write_machine

GIB = 2**30
UNIFIED = {"name": "tier-unified", "unified": True, "gpu": {"tflops": {"fp4": 1e6, "fp8": 1e6, "bf16": 1e6}},
           "host": {"memory_gib": 64, "bandwidth_gbs": 400}, "disk": {"read_gbs": 4}}


def _hand(resident: int, host: int, disk: int) -> dict[str, float]:
    """One decode token (concurrency 1, no drafting) on BOX, by hand. A token selects top_k experts in each MoE
    layer; uniform routing puts each in a tier with probability (that tier's experts) / E."""
    m = resolve_model(MODEL)
    e = resident + host + disk
    assert e == m.n_experts == 256 and m.top_k == 6
    expert_bytes = m.expert_params * FP4
    selected = m.n_moe_layers * m.top_k * expert_bytes  # routed-expert bytes one token reads, all tiers
    dense = m.dense_params_decode * 1.0  # FP8 dense weights beside FP4 experts
    kv = m.kv_read_bytes(CTX)
    return {"selected": selected, "dense_kv": dense + kv, "gpu_experts": selected * resident / e,
            "host_experts": selected * host / e, "disk_experts": selected * disk / e,
            "fixed": m.n_layers * LAYER_US * 1e-6, "flops_per_expert_token": 2.0 * m.expert_params}


def test_gpu_host_and_disk_tiers_by_hand(tmp_path, capsys) -> None:
    """16 experts per layer on the GPU, 176 in host memory computed by the CPU, 64 read from disk."""
    box = write_machine(tmp_path, BOX)
    d = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS,
                       "--resident-experts", "16", "--host-experts", "176"])
    h = _hand(16, 176, 64)
    gpu_bytes = h["dense_kv"] + h["gpu_experts"]
    host_bytes = h["host_experts"] + h["disk_experts"]  # disk pages are computed from host memory by the CPU
    t_gpu = gpu_bytes / (1000e9 * ETA_MEM)
    t_host = host_bytes / (200e9 * ETA_MEM)
    t_disk = h["disk_experts"] / 5e9
    step = t_gpu + t_host + t_disk + h["fixed"]

    s = d["step"]
    assert s["bytes_total"] == pytest.approx(gpu_bytes, rel=1e-9)
    assert s["bytes_host_experts"] == pytest.approx(host_bytes, rel=1e-9)
    assert s["bytes_disk_experts"] == pytest.approx(h["disk_experts"], rel=1e-9)
    assert d["step_time_ms"] == pytest.approx(step * 1e3, rel=1e-9)
    assert d["decode_tiers"]["decode_tokens_per_s_per_agent"] == pytest.approx(1.0 / step, rel=1e-9)
    assert d["bound"] == "disk"
    tiers = {row["tier"]: row for row in d["decode_tiers"]["tiers"]}
    assert list(tiers) == ["GPU memory", "host memory", "disk", "fixed"]
    assert tiers["GPU memory"]["time_ms"] == pytest.approx(t_gpu * 1e3, rel=1e-9)
    assert tiers["host memory"]["time_ms"] == pytest.approx(t_host * 1e3, rel=1e-9)
    assert tiers["disk"]["time_ms"] == pytest.approx(t_disk * 1e3, rel=1e-9)
    assert tiers["disk"]["bytes_per_token"] == pytest.approx(h["disk_experts"], rel=1e-9)
    assert tiers["fixed"]["time_ms"] == pytest.approx(h["fixed"] * 1e3, rel=1e-9)
    assert d["decode_tiers"]["bottleneck"] == "disk" and d["decode_tiers"]["combined"] == "summed"
    # the expert bytes of the three tiers add up to what a token selects
    assert (h["gpu_experts"] + h["host_experts"] + h["disk_experts"]) == pytest.approx(h["selected"])
    placement = d["machine"]["placement"]
    assert (placement["resident_experts_per_layer"], placement["host_experts_per_layer"],
            placement["disk_experts_per_layer"], placement["host_expert_compute"]) == (16, 176, 64, "cpu")


def test_host_experts_moved_over_the_link(tmp_path, capsys) -> None:
    """--host-expert-compute gpu: the 240 host-memory experts per layer cross the 50 GB/s link and are read
    again from GPU memory; the GPU computes them."""
    d = plan_json(capsys, ["--hardware", write_machine(tmp_path, BOX), "--model", MODEL, "--context", str(CTX), *TERMS,
                       "--resident-experts", "16", "--host-expert-compute", "gpu"])
    h = _hand(16, 240, 0)
    t_gpu = (h["dense_kv"] + h["selected"]) / (1000e9 * ETA_MEM)
    t_link = h["host_experts"] / (50e9 * ETA_COMM)
    step = t_gpu + t_link + h["fixed"]
    assert d["step"]["bytes_host_experts"] == pytest.approx(h["host_experts"], rel=1e-9)
    assert d["step"]["bytes_disk_experts"] == 0
    assert d["decode_tiers"]["decode_tokens_per_s_per_agent"] == pytest.approx(1.0 / step, rel=1e-9)
    assert d["bound"] == "link" and d["decode_tiers"]["bottleneck"] == "host memory"
    assert [row["tier"] for row in d["decode_tiers"]["tiers"]] == ["GPU memory", "host memory", "fixed"]


def test_the_cpu_kernels_bound_by_their_flops(tmp_path, capsys) -> None:
    """With host.expert_tflops given, the CPU tier takes the slower of its reads and its FLOPs."""
    box = json.loads(json.dumps(BOX))
    box["host"]["expert_tflops"] = 0.05
    d = plan_json(capsys, ["--hardware", write_machine(tmp_path, box), "--model", MODEL, "--context", str(CTX), *TERMS,
                       "--resident-experts", "16"])
    h = _hand(16, 240, 0)
    m = resolve_model(MODEL)
    flops = m.n_moe_layers * m.top_k * h["flops_per_expert_token"] * 240 / 256
    t_cpu = flops / (0.05e12 * ETA_FLOP)
    assert t_cpu > h["host_experts"] / (200e9 * ETA_MEM)  # the case is FLOP-bound, as meant
    tiers = {row["tier"]: row for row in d["decode_tiers"]["tiers"]}
    assert tiers["host memory"]["time_ms"] == pytest.approx(t_cpu * 1e3, rel=1e-9)
    assert d["step"]["flops_host_experts"] == pytest.approx(flops, rel=1e-9)


def test_a_unified_machine_streams_the_rest_from_disk(tmp_path, capsys) -> None:
    """Unified memory: 60 experts per layer resident, 196 read from the 4 GB/s disk into the same memory."""
    unified = write_machine(tmp_path, UNIFIED)
    d = plan_json(capsys, ["--hardware", unified, "--model", MODEL, "--context", str(CTX), *TERMS,
                       "--resident-experts", "60"])
    h = _hand(60, 0, 196)
    t_mem = (h["dense_kv"] + h["gpu_experts"] + h["disk_experts"]) / (400e9 * ETA_MEM)
    t_disk = h["disk_experts"] / 4e9
    assert d["step"]["bytes_disk_experts"] == pytest.approx(h["disk_experts"], rel=1e-9)
    assert d["decode_tiers"]["decode_tokens_per_s_per_agent"] == pytest.approx(1.0 / (t_mem + t_disk + h["fixed"]),
                                                                               rel=1e-9)
    assert [row["tier"] for row in d["decode_tiers"]["tiers"]] == ["unified memory", "disk", "fixed"]


def test_all_experts_resident_is_the_plan_without_the_flags(tmp_path, capsys) -> None:
    box = write_machine(tmp_path, BOX)
    argv = ["--hardware", box, "--model", MODEL, "--gpu-memory", "200"]
    plain = plan_json(capsys, argv)
    placed = plan_json(capsys, argv + ["--resident-experts", "256", "--host-experts", "0"])
    for key in ("tokens_per_s_per_agent", "step_time_ms", "sessions_fit", "ttft_ms"):
        assert placed[key] == plain[key], key
    assert plain["machine"]["placement"] is None
    assert [row["tier"] for row in plain["decode_tiers"]["tiers"]] == ["GPU memory", "fixed"]
    assert "decode_tiers" not in plan_json(capsys, ["--hardware", "h200", "--model", MODEL])


def _misfit(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    return " ".join(capsys.readouterr().err.split())


def test_the_gpu_misfit_says_how_many_experts_stay(tmp_path, capsys) -> None:
    """The refusal names the largest resident count that fits: that count fits, one more does not."""
    m = resolve_model(MODEL)
    workspace = json.loads(HARDWARE_JSON.read_text())["efficiency"]["machine-prior"]["workspace_fraction"]["value"]
    ctx = 1024 + 1024 / 2  # the default context: prompt + output / 2
    room = 24 * GIB * (1 - workspace) - m.dense_params_total * 1.0 - m.sequence_bytes(ctx)
    per_expert = m.n_moe_layers * m.expert_params * FP4  # one more resident expert in every layer
    n = math.floor(room / per_expert)
    assert 0 < n < 256
    box = write_machine(tmp_path, BOX)
    argv = ["--hardware", box, "--model", MODEL]
    err = _misfit(capsys, argv)
    assert f"holds {n} of the 256 per layer" in err and f"--resident-experts {n};" in err
    assert f"the other {256 - n} per layer" in err and "go to host memory" in err
    assert plan_json(capsys, argv + ["--resident-experts", str(n)])["fits"] is True
    assert "the weights need" in _misfit(capsys, argv + ["--resident-experts", str(n + 1)])


def test_the_host_misfit_says_how_many_experts_go_to_disk(tmp_path, capsys) -> None:
    m = resolve_model(MODEL)
    per_expert = m.n_moe_layers * m.expert_params * FP4
    host_gib = 64
    fit = math.floor(host_gib * GIB / per_expert)
    box = write_machine(tmp_path, BOX)
    argv = ["--hardware", box, "--model", MODEL, "--host-memory", str(host_gib), "--resident-experts", "20"]
    err = _misfit(capsys, argv)
    assert f"236 experts per layer in host memory need {236 * per_expert / 1e9:,.1f} GB" in err
    assert f"--resident-experts 20 --host-experts {fit} reads the other {236 - fit} per layer from disk" in err
    assert plan_json(capsys, argv + ["--host-experts", str(fit)])["fits"] is True
    assert "in host memory need" in _misfit(capsys, argv + ["--host-experts", str(fit + 1)])


def test_the_misfit_beyond_host_memory_points_to_disk(tmp_path, capsys) -> None:
    """A GPU and host memory too small for every expert: the advice splits GPU, host and disk."""
    box = json.loads(json.dumps(BOX))
    box["host"]["memory_gib"] = 32
    err = _misfit(capsys, ["--hardware", write_machine(tmp_path, box), "--model", MODEL])
    assert "and host memory holds" in err and "from disk" in err and "--host-experts" in err


@pytest.mark.parametrize("extra,flag,message", [
    (["--hardware", "h200", "--resident-experts", "10"], "--resident-experts", "datacenter preset h200"),
    (["--resident-experts", "257"], "--resident-experts", "exceeds the 256 routed experts"),
    (["--resident-experts", "-1"], "--resident-experts", "must be an integer >= 0"),
    (["--resident-experts", "200", "--host-experts", "100"], "--host-experts", "exceed the 256 routed experts"),
    (["--host-expert-compute", "gpu"], "--host-expert-compute", "needs --resident-experts or --host-experts"),
    (["--resident-experts", "10", "--host-experts", "10", "--disk-bandwidth", "0"], "--disk-bandwidth",
     "must be a positive number"),
])
def test_placement_flags_refused(tmp_path, capsys, extra, flag, message) -> None:
    argv = ["--hardware", write_machine(tmp_path, BOX), "--model", MODEL, *extra]
    if "h200" in extra:
        argv = ["--model", MODEL, *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: " in err and message in err and "Traceback" not in err


def test_placement_needs_the_bandwidth_of_each_tier(tmp_path, capsys) -> None:
    box = json.loads(json.dumps(BOX))
    del box["disk"]
    del box["host"]["bandwidth_gbs"]
    path = write_machine(tmp_path, box)
    assert main(["--hardware", path, "--model", MODEL, "--resident-experts", "10", "--host-experts", "10"]) == 2
    assert "error: --disk-bandwidth: 236 experts per layer are read from disk" in capsys.readouterr().err
    assert main(["--hardware", path, "--model", MODEL, "--resident-experts", "10"]) == 2
    assert "error: --host-bandwidth: the CPU computes 246 experts per layer" in capsys.readouterr().err
    # over the link the host bandwidth is not needed
    assert main(["--hardware", path, "--model", MODEL, "--resident-experts", "10", "--host-expert-compute",
                 "gpu", "--json"]) == 0
    capsys.readouterr()
    unified = write_machine(tmp_path, UNIFIED, "u.json")
    assert main(["--hardware", unified, "--model", MODEL, "--host-experts", "4"]) == 2
    assert "error: --host-experts: tier-unified is a unified machine" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--hardware", path, "--model", MODEL, "--resident-experts", "10", "--host-expert-compute", "tpu"])
    assert exc.value.code == 2
    capsys.readouterr()


def test_explain_shows_the_tiers_and_the_bottleneck(tmp_path, capsys) -> None:
    assert main(["--hardware", write_machine(tmp_path, BOX), "--model", MODEL, "--resident-experts", "16",
                 "--host-experts", "176", "--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "[tiers]" in lines and max(len(line) for line in lines) <= 80
    text = " ".join(" ".join(lines).split())
    for words in ("GPU memory: bytes per token", "host memory: time", "disk: time", "bottleneck: disk",
                  "16 of 256 routed experts per layer", "at 5 GB/s x 1: read at the disk's stated bandwidth"):
        assert words in text, words
    assert main(["--hardware", write_machine(tmp_path, BOX), "--model", MODEL, "--resident-experts", "16",
                 "--host-experts", "176"]) == 0
    out = capsys.readouterr().out
    assert "decode tiers (summed; bottleneck disk)" in out and "GB/token" in out


def test_too_many_sessions_says_how_many_experts_to_move(tmp_path, capsys) -> None:
    """Sessions beyond the GPU's room: the refusal names a resident count at which they fit, and it is the
    largest such count."""
    argv = ["--hardware", write_machine(tmp_path, BOX), "--model", MODEL, "--resident-experts", "20",
            "--concurrency", "20", "--context", "100000"]
    err = _misfit(capsys, argv)
    assert "20 sessions at context 100,000 need" in err and "the others to host memory) makes room" in err
    named = int(err.split("(--resident-experts ")[1].split(",")[0])
    assert 0 <= named < 20
    changed = [*argv[:5], str(named), *argv[6:]]
    assert plan_json(capsys, changed)["sessions_fit"] >= 20
    changed[5] = str(named + 1)
    assert "sessions at context" in _misfit(capsys, changed)
