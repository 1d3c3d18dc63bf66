"""Weights streamed under a weight budget (``weight_memory``): each MoE layer holds a few experts in slots and reads
the others from the checkpoint's files when routed, each engram table holds some of its rows and reads the others
when a step's n-grams name them; the greedy tokens are those of the engine that holds every weight, the resident
weights stay within the budget, and the caches count what they read (flashserve/model/expert_cache.py,
flashserve/model/row_cache.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_helpers import prompt_of, run_greedy
from flashserve.config import ConfigError
from flashserve.engine import EngineConfig, LLMEngine
from flashserve.engine.execution import FP8_PANELS
from flashserve.model.expert_cache import cache_stats, expert_caches
from flashserve.model.loader import load_model
from flashserve.model.mapped import weights_held
from flashserve.model.moe import MoE


@pytest.fixture(scope="module")
def released(released_tiny_v41) -> Path:
    """tiny-v41 as released (MXFP4 experts: 8 a layer, 10 MoE layers)."""
    return released_tiny_v41


def _engine(path: Path, **kw) -> LLMEngine:
    kw.setdefault("enforce_eager", True)  # eager unless a test compiles (the compiled twin: same tokens)
    kw.setdefault("speculative_config", None)
    kw.setdefault("max_num_seqs", 4)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_memory="64MiB", **kw))


def _weights(model) -> int:
    tensors = {t.untyped_storage().data_ptr(): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


@pytest.mark.parametrize("policy,compiled", [("lru", True), ("lfu", False)])
def test_streamed_experts_give_the_tokens_of_held_ones_within_the_budget(released, policy, compiled):
    """Eager, and compiled (dynamo's trace of the step: the caches run behind custom operators the graph calls;
    inductor's build of the same graph is a benchmark's, scripts/bench_slice.py)."""
    whole = _weights(load_model(released, with_mtp=False))  # the weights as loaded
    # the reference holds every weight, and its FP8 layers read their codes as stored, as the streamed engine's do
    # (the FP8 panels' sums run in another order, which moves logits across the cache's rounding steps)
    held = _engine(released, weight_memory=whole)
    assert not expert_caches(held.model) and held.plan.relayouts[FP8_PANELS] == []
    moe = [m for m in held.model.modules() if isinstance(m, MoE)]
    expert = sum(t.numel() * t.element_size() for m in moe for t in m.experts.buffers() if t.dim() == 3) // 8
    budget = whole - 5 * expert  # three experts of eight a layer
    prompts = [prompt_of(30, seed=1), prompt_of(12, seed=2), prompt_of(21, seed=3)]
    expected = run_greedy(held, prompts, 8)

    # compiled: one sequence at a time, so one batch size's graphs are traced
    engine = _engine(released, weight_memory=budget, expert_cache_policy=policy, enforce_eager=not compiled,
                     compile_backend="eager", background_compile=False, max_num_seqs=1 if compiled else 4)
    assert (engine.runner.decode_step.regions is not None) == compiled
    slots = {m.experts.n_experts for m in engine.model.modules() if isinstance(m, MoE)}
    # the engram tables' 12458 rows keep 8192: an expert more; what is left over, a slot more in some layers
    assert max(slots) - min(slots) <= 1 and 3 <= min(slots) < 8
    assert all(m.expert_cache.policy == policy for m in engine.model.modules() if isinstance(m, MoE))
    assert _weights(engine.model) <= budget and engine.plan.relayouts[FP8_PANELS] == []
    assert run_greedy(engine, prompts, 8) == expected
    stats = engine.stats()["expert_cache"]
    assert stats["slots"] in slots and stats["experts"] == 8 and stats["layers"] == 10 and stats["policy"] == policy
    # every miss and every expert read ahead of its router read one expert's three MXFP4 matrices and their scales
    read = stats["misses"] + stats["read_ahead"]
    assert stats["misses"] > 0 and stats["hits"] > 0 and stats["bytes_read"] == read * expert // 10
    assert 0 <= stats["read_ahead_used"] <= stats["read_ahead"]
    rows = engine.stats()["engram_row_cache"]
    assert rows["layers"] == 2 and rows["slots"] == 2 * 4096 and rows["rows"] == 6126 + 6332
    # a row is 16 FP8 bytes and one scale byte; decoding repeats n-grams, so rows are found as well as read
    assert rows["misses"] > 0 and rows["hits"] > 0 and rows["bytes_read"] == rows["misses"] * 17
    if compiled:  # every region's graph called directly, the caches' operators inside the MoE and engram ones
        assert engine.runner.decode_step.regions.planned()


def test_engram_rows_streamed_through_a_few_slots_give_the_logits_of_the_whole_tables(released, monkeypatch):
    """Sixteen rows a table (one set): a ten-token prompt names 60 rows a table, so the cache serves it sixteen
    at a time; a second forward of the same prompt reads them again (nothing it needs stays)."""
    from flashserve.model import loader, row_cache

    monkeypatch.setattr(row_cache, "MIN_ROWS", 16)
    monkeypatch.setattr(loader, "ROW_SHARE", 1 << 40)
    ref = load_model(released, with_mtp=False)
    moe = [m for m in ref.modules() if isinstance(m, MoE)]
    expert = sum(t.numel() * t.element_size() for m in moe for t in m.experts.buffers() if t.dim() == 3) // 8
    model = load_model(released, with_mtp=False, weight_memory=_weights(ref) - 4 * expert)
    caches = row_cache.row_caches(model)
    assert [(c.rows, c.slots, c.sets.sets) for c in caches] == [(6126, 16, 1), (6332, 16, 1)]
    assert cache_stats(expert_caches(model))["slots"] < 8
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3, 3, 9]])
    with torch.inference_mode():
        expected = ref(ids).logits
        assert torch.equal(model(ids).logits, expected)
        assert torch.equal(model(ids).logits, expected)
    stats = row_cache.row_cache_stats(caches)
    looked = 2 * (59 + 60)  # distinct rows of the prompt in tables 1 and 4, twice
    assert stats["hits"] + stats["misses"] == looked and stats["misses"] >= looked - 2 * 16


def test_a_step_routing_to_more_experts_than_a_layer_holds_runs_them_a_slotful_at_a_time(released, monkeypatch):
    """Two slots a layer (the router's top-2), ten tokens at once: the whole-sequence forward runs each layer's
    experts in groups and its logits equal those of the model that holds every expert."""
    from flashserve.model import row_cache

    monkeypatch.setattr(row_cache, "MIN_ROWS", 1 << 30)  # the engram tables held whole
    ref = load_model(released, with_mtp=False)
    moe = [m for m in ref.modules() if isinstance(m, MoE)]
    expert = sum(t.numel() * t.element_size() for m in moe for t in m.experts.buffers() if t.dim() == 3) // 8
    model = load_model(released, with_mtp=False, weight_memory=_weights(ref) - 6 * expert)
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3, 3, 9]])
    with torch.inference_mode():
        assert torch.equal(ref(ids).logits, model(ids).logits)
    stats = cache_stats(expert_caches(model))
    assert stats["slots"] == 2 and stats["misses"] > 10  # more than a slotful a layer was read


def test_a_budget_below_what_the_model_needs_is_refused_with_the_least_that_does(released):
    with pytest.raises(ConfigError, match=r"weight memory 1000 bytes cannot hold this model: its weights other than "
                                          r"the routed experts and engram tables take \d+ bytes \(the decode step's copies included\), "
                                          r"each of its 10 MoE layers needs at least its router's 2 experts' slots .* engram tables at "
                                          r"least 4096 rows; give at least \d+ bytes"):
        load_model(released, with_mtp=False, weight_memory=1000)
    with pytest.raises(ConfigError, match="weight_memory: streams the routed experts from a checkpoint folder; "
                                          "'tiny-v41' is a preset"):
        LLMEngine(EngineConfig(model="tiny-v41", weight_memory="1GiB"))
    with pytest.raises(ConfigError, match="weight_memory: invalid size"):
        LLMEngine(EngineConfig(model=str(released), weight_memory="lots"))


def test_an_engine_over_experts_used_where_they_lie_decodes_compiled_with_the_same_tokens(released, monkeypatch):
    """Experts held one matrix an expert (views of the files) run through the kernel's address tables: a compiled
    step takes them as it takes stacked ones, and gives the eager stacked engine's tokens."""
    from flashserve.model import mapped_experts

    prompts = [prompt_of(30, seed=4), prompt_of(7, seed=5)]
    expected = run_greedy(_engine(released, mmap=False), prompts, 8)
    monkeypatch.setattr(mapped_experts, "MIN_EXPERT_BYTES", 0)
    # dynamo traces (inductor not needed), one sequence at a time: one batch size's graphs
    engine = _engine(released, enforce_eager=False, compile_backend="eager", max_num_seqs=1)
    engine.wait_compiled()
    assert isinstance(engine.model.layers[0].ffn.experts, mapped_experts.MappedExperts)
    assert engine.runner.decode_step.regions is not None and engine.plan.formats["mxfp4 experts (mapped)"] == 10
    assert run_greedy(engine, prompts, 8) == expected
    assert engine.runner.decode_step.regions.planned()  # each kind's graph called for its layers


def test_a_full_set_gives_up_its_least_recently_used_row():
    from flashserve.model.row_cache import Sets

    reads = []
    sets = Sets(2, 2, lambda rows, slots: reads.append(rows.tolist()) or len(rows))  # one set of two ways
    for row in (10, 20, 10, 30, 20):
        sets.placed(np.array([row]))
    assert reads == [[10], [20], [30], [20]]  # 30 evicted 20 (10 was used since), then 20 evicted 10
    assert sorted(sets.tags[0].tolist()) == [20, 30] and (sets.hits, sets.misses) == (1, 4)
    assert sets.placed(np.array([1, 2, 3])) is None  # three rows in a set of two ways: served a wayful at a time


@pytest.fixture(scope="module")
def with_drafter(tmp_path_factory) -> Path:
    """tiny-v41 as released with its DSpark drafter (three stages of 4 experts; the model's layers have 8)."""
    from flashserve.config import load_config
    from flashserve.model.checkpoint import save_checkpoint

    path = tmp_path_factory.mktemp("tiny_v41_drafter")
    save_checkpoint(load_model("tiny-v41", with_mtp=True).checkpoint_tensors(), path, load_config("tiny-v41"))
    return path


def _expert_bytes(model) -> int:
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    return sum(t.numel() * t.element_size() for t in moe[0].experts.buffers() if t.dim() == 3) // 8


def test_a_budget_with_the_drafter_gives_each_layer_slots_of_its_own_experts_and_dspark_its_tokens(with_drafter,
                                                                                                   monkeypatch):
    """The drafter's layers hold 4 experts where the model's hold 8: each layer keeps the same share of its own,
    and DSpark drafts through the streamed experts with the tokens of the engine holding every weight."""
    from flashserve.model import row_cache

    monkeypatch.setattr(row_cache, "MIN_ROWS", 1 << 30)  # the engram tables held whole: the experts give way
    dspark = {"method": "dspark", "num_speculative_tokens": 3}
    whole = _weights(load_model(with_drafter))
    held = _engine(with_drafter, speculative_config=dspark, weight_memory=whole)  # every weight, no FP8 panels
    assert not expert_caches(held.model) and held.plan.relayouts[FP8_PANELS] == []
    prompts = [prompt_of(30, seed=1), prompt_of(12, seed=2)]
    expected = run_greedy(held, prompts, 10)
    budget = whole - 23 * _expert_bytes(held.model)  # 69 of the 92 experts: three quarters of each layer's
    engine = _engine(with_drafter, speculative_config=dspark, weight_memory=budget)
    slots = {name: m.experts.n_experts for name, m in engine.model.named_modules() if isinstance(m, MoE)}
    main = {slots[f"layers.{i}.ffn"] for i in range(10)}
    drafter = {slots[f"mtp.{i}.ffn"] for i in range(3)}
    assert main == {6} and drafter == {3}, slots  # three quarters of 8 and of 4
    assert _weights(engine.model) <= budget
    assert run_greedy(engine, prompts, 10) == expected
    assert engine.spec_stats.num_draft_tokens > 0  # the drafter ran
    stats = engine.stats()["expert_cache"]
    assert stats["layers"] == 13 and stats["misses"] > 0


def test_the_budget_holds_the_plans_copies_and_fp8_panels_where_they_fit(released, monkeypatch):
    """The bf16 LM head held as stored is read through bfloat16 panels (a copy the plan makes): the budget counts
    them, so what the process holds for the weights after the plan stays within it. A budget with room for the
    FP8 panels too gets them; one just short of them holds every weight and reads the codes as stored."""
    from flashserve.model import blas, loader

    monkeypatch.setattr(blas, "BF16_PANEL_MIN_ELEMENTS", 1 << 14)  # the tiny head (512 x 64) counts as large
    monkeypatch.setattr(loader, "KEEP_STORED_MIN_ELEMENTS", 1 << 14)
    roomy = _engine(released, weight_memory="64GiB")
    head = roomy.model.head
    assert head.weight.dtype == torch.bfloat16 and roomy.plan.relayouts["bfloat16 panels of bf16 weights"]
    assert roomy.plan.relayouts[FP8_PANELS] and not expert_caches(roomy.model)
    everything = weights_held(roomy.model)["total"]  # weights, head panels and FP8 panels
    panels = roomy.plan.relayout_bytes[FP8_PANELS]

    exact = _engine(released, weight_memory=everything)
    assert exact.plan.relayouts[FP8_PANELS] and not expert_caches(exact.model)
    assert weights_held(exact.model)["total"] <= everything

    short = _engine(released, weight_memory=everything - 1)  # no room for the FP8 panels: every expert still held
    assert short.plan.relayouts[FP8_PANELS] == [] and not expert_caches(short.model)
    assert short.plan.relayouts["bfloat16 panels of bf16 weights"]
    assert weights_held(short.model)["total"] <= everything - panels

    tight = everything - panels - 3 * 10 * _expert_bytes(roomy.model) - 12458 * 17  # rows and experts streamed
    engine = _engine(released, weight_memory=tight)
    assert expert_caches(engine.model) and engine.plan.relayouts["bfloat16 panels of bf16 weights"]
    assert weights_held(engine.model)["total"] <= tight
    prompts = [prompt_of(20, seed=7), prompt_of(9, seed=8)]
    assert run_greedy(engine, prompts, 6) == run_greedy(short, prompts, 6)


def test_a_budget_on_a_cuda_device_is_refused_before_loading(released):
    with pytest.raises(ConfigError, match="weight_memory: streams the routed experts into host memory for CPU "
                                          "steps; on a CUDA device hold the experts that fit there with gpu_experts"):
        LLMEngine(EngineConfig(model=str(released), device="cuda", weight_memory="1GiB"))
    with pytest.raises(ConfigError, match="on cuda hold the experts that fit there with gpu_experts"):
        load_model(released, device="cuda", weight_memory=1 << 30)
