"""How an engine serves the tiers, as the planner takes it: a measured expert-cache hit rate, tiers that overlap,
a CPU expert kernel's measured read rate, prefill in chunks with experts off the device, engram tables on disk
and a device without published FLOP/s. Each time is recomputed here by hand from the model's terms and the
machine's figures; the flags' refusals exit with status 2."""

from __future__ import annotations

import math

import pytest

from flashserve.config import load_config
from flashserve.plan.cli import main
from flashserve.plan.models import resolve_model
from tier_box import BOX, CTX, ETA_COMM, ETA_MEM, FP4, LAYER_US, MODEL, TERMS, plan_json, write_machine

SPLIT = ["--resident-experts", "16", "--host-experts", "176"]  # and 64 per layer on disk


def _token() -> dict[str, float]:
    """One decode token of V4-Flash at concurrency 1: the routed bytes it selects over every tier, the device's
    dense and cache bytes, the fixed time."""
    m = resolve_model(MODEL)
    assert m.n_experts == 256 and m.top_k == 6
    return {"selected": m.n_moe_layers * m.top_k * m.expert_params * FP4,
            "dense_kv": m.dense_params_decode * 1.0 + m.kv_read_bytes(CTX), "fixed": m.n_layers * LAYER_US * 1e-6}


def test_a_measured_hit_rate_replaces_uniform_routing(tmp_path, capsys) -> None:
    """Half the selected experts found resident: the other half split 176 : 64 over host memory and disk
    (uniform routing would find 16/256 of them resident)."""
    box = write_machine(tmp_path, BOX)
    d = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS, *SPLIT,
                       "--expert-hit-rate", "0.5"])
    h = _token()
    gpu = h["dense_kv"] + 0.5 * h["selected"]
    host = 0.5 * h["selected"]  # host and disk experts alike are computed from host memory by the CPU
    disk = 0.5 * h["selected"] * 64 / 240
    step = gpu / (1000e9 * ETA_MEM) + host / (200e9 * ETA_MEM) + disk / 5e9 + h["fixed"]
    s = d["step"]
    assert s["bytes_total"] == pytest.approx(gpu, rel=1e-9)
    assert s["bytes_host_experts"] == pytest.approx(host, rel=1e-9)
    assert s["bytes_disk_experts"] == pytest.approx(disk, rel=1e-9)
    assert d["step_time_ms"] == pytest.approx(step * 1e3, rel=1e-9)
    assert d["machine"]["placement"]["expert_hit_rate"] == 0.5
    assert "measured hit rate 0.5" in d["machine"]["placement"]["routing"]


def test_overlapped_tiers_take_the_slowest(tmp_path, capsys) -> None:
    box = write_machine(tmp_path, BOX)
    h = _token()
    t_gpu = (h["dense_kv"] + h["selected"] * 16 / 256) / (1000e9 * ETA_MEM)
    t_host = h["selected"] * 240 / 256 / (200e9 * ETA_MEM)
    t_disk = h["selected"] * 64 / 256 / 5e9
    summed = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS, *SPLIT])
    over = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS, *SPLIT,
                          "--tier-overlap", "overlapped"])
    assert summed["step_time_ms"] == pytest.approx((t_gpu + t_host + t_disk + h["fixed"]) * 1e3, rel=1e-9)
    assert over["step_time_ms"] == pytest.approx((max(t_gpu, t_host, t_disk) + h["fixed"]) * 1e3, rel=1e-9)
    assert over["decode_tiers"]["combined"] == "overlapped" and summed["decode_tiers"]["combined"] == "summed"


def test_a_measured_cpu_kernel_rate_times_the_host_tier(tmp_path, capsys) -> None:
    """host.expert_gbs (a CPU expert kernel's measured read rate) replaces host bandwidth x efficiency."""
    box = write_machine(tmp_path, {**BOX, "host": {**BOX["host"], "expert_gbs": 80}})
    d = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS,
                       "--resident-experts", "16"])
    h = _token()
    host = h["selected"] * 240 / 256
    assert d["step"]["t_host"] == pytest.approx(host / 80e9, rel=1e-9)
    # a machine that gives only the kernel rate, no host bandwidth, can still place experts on the CPU
    rate_only = write_machine(tmp_path, {**BOX, "host": {"memory_gib": 512, "expert_gbs": 80}}, "rate.json")
    d = plan_json(capsys, ["--hardware", rate_only, "--model", MODEL, "--resident-experts", "16"])
    assert d["step"]["t_host"] > 0


def test_a_machine_without_a_gpu_times_its_experts_at_the_kernels_rate(tmp_path, capsys) -> None:
    """No GPU, host.expert_gbs given: the dense work is timed on host memory (or the CPU's FLOP/s) and every
    selected expert at the kernels' rate after it, with or without a placement; experts paged in from disk are
    read once from the disk and once more by the kernels."""
    cpu = {"name": "cpu-box", "host": {"memory_gib": 512, "bandwidth_gbs": 200, "expert_gbs": 40,
                                       "expert_tflops": 1e6}, "disk": {"read_gbs": 5}}
    box = write_machine(tmp_path, cpu)
    h = _token()
    dense = h["dense_kv"] / (200e9 * ETA_MEM)
    d = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS])
    assert d["step"]["t_host"] == pytest.approx(h["selected"] / 40e9, rel=1e-9)
    assert d["step_time_ms"] == pytest.approx((dense + h["selected"] / 40e9 + h["fixed"]) * 1e3, rel=1e-9)
    rows = {row["tier"]: row for row in d["decode_tiers"]["tiers"]}
    assert rows["CPU expert kernels"]["time_ms"] == pytest.approx(h["selected"] / 40e9 * 1e3, rel=1e-9)
    assert rows["CPU expert kernels"]["bytes_per_step"] == pytest.approx(h["selected"], rel=1e-9)
    d = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS,
                           "--resident-experts", "192", "--expert-hit-rate", "0.75"])
    disk = 0.25 * h["selected"] / 5e9
    assert d["step_time_ms"] == pytest.approx((dense + h["selected"] / 40e9 + disk + h["fixed"]) * 1e3, rel=1e-9)
    # without the kernels' rate the experts are read from host memory with the dense weights, as before
    plain = write_machine(tmp_path, {**cpu, "host": {"memory_gib": 512, "bandwidth_gbs": 200,
                                                     "expert_tflops": 1e6}}, "plain.json")
    d = plan_json(capsys, ["--hardware", plain, "--model", MODEL, "--context", str(CTX), *TERMS])
    assert d["step"]["t_host"] == 0
    assert d["step_time_ms"] == pytest.approx(((h["dense_kv"] + h["selected"]) / (200e9 * ETA_MEM) + h["fixed"])
                                              * 1e3, rel=1e-9)


@pytest.mark.parametrize("compute", ["cpu", "gpu"])
def test_prefill_reads_or_moves_the_experts_a_chunk_touches(tmp_path, capsys, compute) -> None:
    """With uniform routing a 512-token chunk touches E(1 - (1 - k/E)^512) experts of each layer; the
    off-device ones are read once a chunk from host memory by the CPU (no CPU FLOP/s given: its memory bound),
    or moved over the link, and the disk ones read once a chunk from disk."""
    box = write_machine(tmp_path, BOX)
    d = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS, *SPLIT,
                       "--host-expert-compute", compute, "--prefill-chunk", "512", "--routing-skew", "0"])
    m = resolve_model(MODEL)
    touched = 256 * (1 - (1 - 6 / 256) ** 512)
    per_expert = m.prefill_moe_layers * m.expert_params * FP4
    off = touched * 240 / 256 * per_expert
    t_disk = touched * 64 / 256 * per_expert / 5e9 / 512
    t_host = off / (200e9 * ETA_MEM) / 512 if compute == "cpu" else off / (50e9 * ETA_COMM) / 512
    tiers = d["prefill"]["tiers"]
    assert tiers["experts_touched_per_layer"] == pytest.approx(touched, rel=1e-12)
    assert tiers["t_host"] == pytest.approx(t_host, rel=1e-9) and tiers["t_disk"] == pytest.approx(t_disk, rel=1e-9)
    assert tiers["device_expert_share"] == (16 / 256 if compute == "cpu" else 1.0)
    # the GPU's own share (FLOP/s that never bind) is negligible beside the tiers
    assert d["prefill"]["gpu_seconds_per_token"] == pytest.approx(t_host + t_disk, rel=1e-3)
    parts = {"host" if compute == "cpu" else "link": t_host, "disk": t_disk}
    assert d["prefill"]["bound"] == max(parts, key=parts.get)
    # a larger chunk reads the same experts for more tokens
    big = plan_json(capsys, ["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS, *SPLIT,
                         "--host-expert-compute", compute, "--prefill-chunk", "4096", "--routing-skew", "0"])
    assert big["prefill_tokens_per_s_per_gpu"] > 5 * d["prefill_tokens_per_s_per_gpu"]


def test_without_a_placement_prefill_has_no_tiers(tmp_path, capsys) -> None:
    d = plan_json(capsys, ["--hardware", write_machine(tmp_path, {**BOX, "gpu": {**BOX["gpu"], "memory_gib": 1024}}),
                       "--model", MODEL, *TERMS])
    assert d["prefill"]["tiers"] is None


def test_engram_tables_on_disk(tmp_path, capsys) -> None:
    """V4.1's tables out of the unified memory; each decode token reads its rows from disk: 24 rows in each of
    its 2 engram layers (48 reads, as llama.cpp PR 28696 counts them), bytes at the disk's bandwidth and one
    read per row at its IOPS."""
    cfg = load_config("deepseek-v41-flash")
    reads = len(cfg.engram_layer_ids) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    assert reads == 48
    row = cfg.engram_head_dim * (1 + 1 / 32)  # FP8 values and one scale byte per 32
    unified = {"name": "tables-box", "unified": True, "gpu": {"tflops": {"fp4": 1e6, "fp8": 1e6, "bf16": 1e6}},
               "host": {"memory_gib": 1024, "bandwidth_gbs": 400}, "disk": {"read_gbs": 4, "iops": 20000}}
    box = write_machine(tmp_path, unified)
    base = ["--hardware", box, "--model", "deepseek-v41-flash", "--context", str(CTX), *TERMS]
    mem = plan_json(capsys, base)
    disk = plan_json(capsys, [*base, "--engram-tables", "disk"])
    assert mem["capacity"]["host_table_bytes_in_device"] > 100e9 and disk["capacity"]["host_table_bytes_in_device"] == 0
    t_tables = reads * row / 4e9 + reads / 20000
    assert disk["step"]["t_disk_tables"] == pytest.approx(t_tables, rel=1e-9)
    assert disk["step"]["bytes_total"] == pytest.approx(mem["step"]["bytes_total"], rel=1e-12)
    assert disk["step_time_ms"] == pytest.approx(mem["step_time_ms"] + t_tables * 1e3 - _engram_link_ms(mem),
                                                 rel=1e-6)
    assert any("engram tables on disk" in line for line in disk["machine"]["planned"])


def _engram_link_ms(d: dict) -> float:
    """The engram rows' share of the step with the tables in memory: their bytes over the host path (the
    unified memory here, at eta_comm), not hidden (comm_overlap 0.5 of the shorter term)."""
    step = d["step"]
    no_rows = max(step["t_mem"], step["t_flop"])
    return (step["t_step"] - step["t_overhead"] - no_rows) * 1e3


def test_a_device_without_flops_is_timed_by_memory_only_when_asked(tmp_path, capsys) -> None:
    """The M3 Ultra preset lists no GPU FLOP/s: no speed without --memory-bound-only; with it, the step is its
    bytes over 819 GB/s x eta_mem plus the fixed time, and the plan says the compute is not timed."""
    argv = ["--hardware", "apple-m3-ultra", "--model", "deepseek-v41-flash", "--weight-dtype", "iq2_xxs-q2_k",
            "--engram-tables", "disk", "--context", str(CTX), *TERMS]
    assert main(argv) == 1
    assert "--memory-bound-only" in capsys.readouterr().err
    d = plan_json(capsys, [*argv, "--memory-bound-only"])
    s = d["step"]
    assert s["t_flop"] == 0.0
    m = resolve_model("deepseek-v41-flash")
    assert d["step_time_ms"] == pytest.approx(
        (s["bytes_total"] / (819e9 * ETA_MEM) + m.n_layers * LAYER_US * 1e-6) * 1e3, rel=1e-9)
    # ds4's Q2 experts: 543.6 B routed weights at 2.25 bits are its stated 142.4 GiB
    assert 543_581_798_400 * 2.25 / 8 / 2**30 == pytest.approx(142.38, abs=0.01)
    assert s["bytes_experts"] == pytest.approx(m.n_moe_layers * 6 * m.expert_params * 2.25 / 8, rel=1e-9)
    assert any("not timed" in line or "timed by memory" in line for line in d["machine"]["not_planned"])
    assert not math.isfinite(d["prefill_tokens_per_s_per_gpu"])


@pytest.mark.parametrize("argv,flag,message", [
    (["--expert-hit-rate", "0.5"], "--expert-hit-rate", "needs --resident-experts"),
    (["--tier-overlap", "overlapped"], "--tier-overlap", "needs --resident-experts"),
    (["--resident-experts", "16", "--expert-hit-rate", "1.5"], "--expert-hit-rate", "between 0.0 and 1.0"),
    (["--resident-experts", "256", "--expert-hit-rate", "0.9"], "--expert-hit-rate", "nothing is missed"),
    (["--prefill-chunk", "0"], "--prefill-chunk", ">= 1"),
    (["--engram-tables", "disk"], "--engram-tables", "has no engram tables"),
])
def test_option_refusals(tmp_path, capsys, argv, flag, message) -> None:
    box = write_machine(tmp_path, BOX)
    assert main(["--hardware", box, "--model", MODEL, *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and message in err


@pytest.mark.parametrize("argv,flag", [(["--engram-tables", "disk"], "--engram-tables"),
                                       (["--memory-bound-only"], "--memory-bound-only")])
def test_machine_options_refused_on_a_datacenter_preset(capsys, argv, flag) -> None:
    assert main(["--hardware", "h200", "--model", "deepseek-v41-flash", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_the_head_dtype_counts_the_lm_head_apart(tmp_path, capsys) -> None:
    """V4.1 ships its LM head (vocabulary x hidden) and embeddings in bf16; an engine computing in fp32 reads
    the head as fp32. Only the head's bytes change, by its parameter count x
    (4 - 1) bytes against FP8 dense weights, and the fit counts the embeddings likewise."""
    cfg = load_config("deepseek-v41-flash")
    head = cfg.vocab_size * cfg.hidden_size
    box = write_machine(tmp_path, {**BOX, "gpu": {**BOX["gpu"], "memory_gib": 1024,
                                           "tflops": {**BOX["gpu"]["tflops"], "fp32": 1e6}}})
    base = ["--hardware", box, "--model", "deepseek-v41-flash", "--context", str(CTX), *TERMS]
    fp8 = plan_json(capsys, base)
    fp32 = plan_json(capsys, [*base, "--head-dtype", "fp32"])
    assert fp32["step"]["bytes_dense"] - fp8["step"]["bytes_dense"] == pytest.approx(head * 3.0, rel=1e-9)
    assert fp32["capacity"]["weight_bytes_per_gpu"] - fp8["capacity"]["weight_bytes_per_gpu"] == pytest.approx(
        2 * head * 3.0, rel=1e-9)  # the embeddings are as large as the head (not tied)
    assert main(["--hardware", box, "--model", "deepseek-r1", "--head-dtype", "fp32"]) == 2
    assert "--head-dtype" in capsys.readouterr().err


def test_the_text_summary_names_how_the_tiers_combine(tmp_path, capsys) -> None:
    box = write_machine(tmp_path, BOX)
    for overlap in ("summed", "overlapped"):
        assert main(["--hardware", box, "--model", MODEL, "--context", str(CTX), *TERMS, *SPLIT,
                     "--tier-overlap", overlap]) == 0
        assert f"decode tiers ({overlap}; bottleneck " in capsys.readouterr().out


def test_engram_tables_beyond_memory_are_sent_to_disk(capsys) -> None:
    """V4.1's engram tables (203 GB) do not fit 128 GiB of host memory, nor beside the weights in a 128 GB unified
    memory: the refusal names --engram-tables disk, which the plan then takes."""
    for argv in (["--hardware", "epyc-ddr5-12ch", "--host-memory", "128"], ["--hardware", "strix-halo"]):
        base = ["--model", "deepseek-v41-flash", *argv, "--memory-bound-only"]
        assert main(base) == 1
        assert "--engram-tables disk" in capsys.readouterr().err, argv
        main(base + ["--engram-tables", "disk", "--disk-bandwidth", "5"])
        assert "--engram-tables disk" not in capsys.readouterr().err, argv
