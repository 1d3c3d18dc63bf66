"""The engine's own placement options in the planner: ``--gpu-experts N`` (flashserve's hybrid split) and
``--weight-memory SIZE`` (flashserve's resident budget, experts streamed through an LRU or LFU cache), split as the
engine splits them and computed here by hand; refusals name the flag and exit with status 2."""

from __future__ import annotations

import pytest

from flashserve.plan.cli import main
from flashserve.plan.model_terms import expert_popularity, lfu_hit_rate, lru_hit_rate
from flashserve.plan.models import resolve_model
from tier_box import BOX, FP4, TERMS, plan_error, plan_json, write_machine

CPU_BOX = {"name": "cpu-box", "host": {"memory_gib": 512, "bandwidth_gbs": 200}, "disk": {"read_gbs": 5}}
GIB = 2**30


def test_lfu_hit_rate_is_the_most_used_experts_share() -> None:
    q = expert_popularity(256, 6, 0.88)
    assert lfu_hit_rate(256, 6, 20, 0.88) == pytest.approx(sum(q[:20]) / 6)
    assert lfu_hit_rate(256, 6, 20, 0.0) == pytest.approx(20 / 256)
    assert lru_hit_rate(256, 6, 20, 0.88) < lfu_hit_rate(256, 6, 20, 0.88)  # recency keeps some rarely used ones


def test_gpu_experts_is_the_hybrid_split(tmp_path, capsys) -> None:
    box = write_machine(tmp_path, BOX)
    base = ["--hardware", box, "--model", "deepseek-v4-flash", *TERMS]
    hybrid = plan_json(capsys, base + ["--gpu-experts", "16"])
    counts = plan_json(capsys, base + ["--resident-experts", "16", "--head-dtype", "bf16"])  # as the engine holds it
    assert hybrid["machine"]["placement"] == counts["machine"]["placement"]
    assert hybrid["machine"]["placement"]["host_experts_per_layer"] == 240
    assert hybrid["step_time_ms"] == counts["step_time_ms"]
    assert plan_error(capsys, base + ["--gpu-experts", "257"]) == "--gpu-experts"
    assert plan_error(capsys, base + ["--gpu-experts", "16", "--resident-experts", "16"]) == "--gpu-experts"
    # the engine's hybrid computes a fixed set on the GPU and the others on the CPU
    refused = base + ["--gpu-experts", "16", "--host-expert-compute", "gpu"]
    assert plan_error(capsys, refused) == "--host-expert-compute"
    assert plan_error(capsys, base + ["--gpu-experts", "16", "--expert-cache", "lru"]) == "--expert-cache"
    cpu = write_machine(tmp_path, CPU_BOX, "cpu.json")
    no_gpu = ["--hardware", cpu, "--model", "deepseek-v4-flash", "--gpu-experts", "4"]
    assert plan_error(capsys, no_gpu) == "--gpu-experts"


def test_weight_memory_holds_the_other_weights_then_slots_of_experts(tmp_path, capsys) -> None:
    """V4-Flash on a CPU machine: the FP8 weights other than the routed experts held whole, then as many experts
    a layer as the rest holds, in an LRU cache (LFU when asked), the others read from disk."""
    cpu = write_machine(tmp_path, CPU_BOX, "cpu.json")
    m = resolve_model("deepseek-v4-flash")
    per = m.n_moe_layers * m.expert_params * FP4  # one expert in every layer
    # FP8 beside MXFP4 experts, the embeddings and head bf16 as the engine holds them
    fixed = (m.dense_params_total - m.head_params - m.embed_params) * 1.0 + (m.head_params + m.embed_params) * 2.0
    budget = int(fixed + 20.5 * per)
    base = ["--hardware", cpu, "--model", "deepseek-v4-flash", *TERMS, "--memory-bound-only",
            "--weight-memory", str(budget)]
    for policy, rate in ((None, lru_hit_rate), ("lfu", lfu_hit_rate)):
        d = plan_json(capsys, base + (["--expert-cache", policy] if policy else []))
        pl = d["machine"]["placement"]
        assert (pl["resident_experts_per_layer"], pl["disk_experts_per_layer"]) == (20, 236)
        assert pl["expert_hit_rate_from"] == (policy or "lru")
        assert pl["expert_hit_rate"] == pytest.approx(rate(256, 6, 20, m.routing_skew), rel=1e-12)
    # a budget that holds every weight places nothing; one below the other weights and top-k experts is refused
    whole = plan_json(capsys, ["--hardware", cpu, "--model", "deepseek-v4-flash", *TERMS, "--memory-bound-only",
                               "--weight-memory", str(int(fixed + 256 * per) + 1)])
    assert whole["machine"]["placement"] is None
    assert plan_error(capsys, ["--hardware", cpu, "--model", "deepseek-v4-flash", "--memory-bound-only",
                               "--weight-memory", str(int(fixed + 256 * per) + 1), "--expert-cache", "lfu"]
                      ) == "--expert-cache"
    # a measured hit rate replaces the cache's
    measured = plan_json(capsys, base + ["--expert-hit-rate", "0.5"])
    assert measured["machine"]["placement"]["expert_hit_rate"] == 0.5
    assert measured["machine"]["placement"]["expert_hit_rate_from"] == "measured"
    small = ["--hardware", cpu, "--model", "deepseek-v4-flash", "--weight-memory", f"{(fixed + 5 * per) / GIB}GiB"]
    assert plan_error(capsys, small) == "--weight-memory"
    box = write_machine(tmp_path, BOX)
    for hw, size in ((box, "8GiB"), (cpu, "lots")):  # a discrete GPU; not a size
        argv = ["--hardware", hw, "--model", "deepseek-v4-flash", "--weight-memory", size]
        assert plan_error(capsys, argv) == "--weight-memory"


def test_weight_memory_gives_engram_tables_a_sixteenth_and_reads_them_from_disk(tmp_path, capsys) -> None:
    """V4.1: the engram tables do not fit beside the experts, so a sixteenth of what the other weights leave goes to
    their row caches and the rows are read from disk (cached rows not credited), the rest to expert slots."""
    cpu = write_machine(tmp_path, CPU_BOX, "cpu.json")
    m = resolve_model("deepseek-v41-flash")
    per = m.n_moe_layers * m.expert_params * FP4
    fixed = (m.dense_params_total - m.head_params - m.embed_params) * 1.0 + (m.head_params + m.embed_params) * 2.0
    budget = int(fixed + 64 * per)
    d = plan_json(capsys, ["--hardware", cpu, "--model", "deepseek-v41-flash", *TERMS, "--memory-bound-only",
                           "--weight-memory", str(budget)])
    assert d["machine"]["placement"]["resident_experts_per_layer"] == int((budget - fixed) * 15 / 16 // per)
    assert d["step"]["t_disk_tables"] > 0  # each token's rows read from the disk


def test_weight_memory_splits_a_budget_as_the_engine_did(capsys) -> None:
    """The engine's stored budget run (tests/plan/data/slice_runs/v41-2-budget.json: a two-layer V4.1-Flash slice
    under 11 GiB, its float32 head and embeddings then copied) held 163 experts a layer; the planner's split of the
    same budget, with the head read as float32, holds the same to one expert (the engine also counts its norms and
    buffers)."""
    import json
    from pathlib import Path

    data = Path(__file__).parent / "data" / "slice_runs"
    run = json.loads((data / "v41-2-budget.json").read_text())
    d = plan_json(capsys, ["--model", str(data / "v41-2.config.json"), "--hardware", str(data / "machine.json"),
                           "--weight-memory", str(run["weight_memory"]), "--head-dtype", "fp32",
                           "--memory-bound-only", "--routing-skew", "0"])
    assert abs(d["machine"]["placement"]["resident_experts_per_layer"] - run["experts_held_per_layer"]) <= 1


def test_sweep_on_a_machine_plans_each_level_with_its_tiers(tmp_path, capsys) -> None:
    """`plan sweep` over concurrency on a machine with experts in host memory: each level is the single plan at that
    concurrency, and the per-agent curve falls as more streams touch more experts the CPU reads."""
    box = write_machine(tmp_path, BOX)
    base = ["--hardware", box, "--model", "deepseek-v4-flash", *TERMS, "--gpu-experts", "16"]
    prefix = tmp_path / "curve"
    assert main(["sweep", *base, "--levels", "1,2,4,8", "--out", str(prefix)]) == 0
    capsys.readouterr()
    import json

    pts = json.loads((tmp_path / "curve.json").read_text())["points"]
    agent = [p["tokens_per_s_per_agent"] for p in pts]
    assert [p["concurrency"] for p in pts] == [1, 2, 4, 8] and agent == sorted(agent, reverse=True)
    for p in pts:
        single = plan_json(capsys, base + ["--concurrency", str(p["concurrency"])])
        assert p["tokens_per_s_per_agent"] == pytest.approx(single["tokens_per_s_per_agent"], rel=1e-12)
        tiers = single["decode_tiers"]
        assert [t["tier"] for t in p["tiers"]] == [t["tier"] for t in tiers["tiers"]]
        assert [t["time_ms"] for t in p["tiers"]] == pytest.approx([t["time_ms"] for t in tiers["tiers"]], rel=1e-12)
        assert p["bottleneck"] == tiers["bottleneck"]
    # the CPU's share grows with the streams: more of them touch more of its experts
    host = [next(t["bytes_per_token"] for t in p["tiers"] if t["tier"] == "host memory") * p["concurrency"]
            for p in pts]
    assert host == sorted(host)
