"""Routed experts split between a GPU and the host (``gpu_experts``, flashserve/model/hybrid.py): a few experts a
layer held in slots, the others computed on the host, the most used moved into the slots as traffic goes. On this
CPU-only machine both sides run on the CPU: every part but the device is tested here (the split, the placement,
equal tokens); scripts/device-check.sh runs it on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import make_engine, prompt_of, run_greedy
from flashserve.config import ConfigError, load_config
from flashserve.engine import EngineConfig, LLMEngine
from flashserve.model import hybrid, mapped_experts
from flashserve.model.checkpoint import save_checkpoint
from flashserve.model.loader import load_model
from flashserve.model.moe import MoE


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """tiny-v41 as released (MXFP4 experts: 8 a layer, 10 MoE layers)."""
    path = tmp_path_factory.mktemp("tiny_v41_hybrid")
    save_checkpoint(load_model("tiny-v41", with_mtp=False).checkpoint_tensors(), path, load_config("tiny-v41"))
    return path


@pytest.mark.parametrize("host", ["stacked", "mapped"])
def test_split_experts_give_the_greedy_tokens_of_the_unsplit_engine(released, monkeypatch, host):
    """Three of eight experts a layer held, rebalanced every four steps while three requests decode: the tokens
    are the unsplit engine's (MXFP4 pairs sum the same on either side), the held experts are the most used, and the
    host side reads its experts stacked or where they lie in the mapped files."""
    if host == "mapped":
        monkeypatch.setattr(mapped_experts, "MIN_EXPERT_BYTES", 0)
    monkeypatch.setattr(hybrid, "REBALANCE_STEPS", 4)
    monkeypatch.setattr("flashserve.engine.llm_engine.REBALANCE_STEPS", 4)
    prompts = [prompt_of(30, seed=1), prompt_of(12, seed=2), prompt_of(21, seed=3)]
    kw = dict(dtype="float32", max_num_seqs=4, speculative_config=None)
    expected = run_greedy(make_engine(load_model(released, with_mtp=False), str(released), **kw), prompts, 12)

    model = load_model(released, with_mtp=False, gpu_experts=3, device="cpu")
    layers = hybrid.hybrid_layers(model)
    assert len(layers) == 10 and all(layer.owner == [0, 1, 2] for layer in layers)
    kind = mapped_experts.MappedExperts if host == "mapped" else type(layers[0].held)
    assert isinstance(layers[0].host, kind) and layers[0].held.n_experts == 3
    assert not any(isinstance(m, mapped_experts.MappedExperts) for m in model.modules())  # the host's: not moved
    engine = make_engine(model, str(released), enforce_eager=False, **kw)
    assert engine.runner.decode_step.regions is None  # the split reads the routing on the host: eager
    assert run_greedy(engine, prompts, 12) == expected
    stats = engine.stats()["hybrid_experts"]
    assert stats["layers"] == 10 and stats["slots"] == 3 and stats["experts"] == 8
    assert stats["copied"] > 30 and 0 < stats["held_share"] < 1  # experts moved in after the first 30 placed
    for layer in layers:  # each slot holds its expert's bytes
        for s, e in enumerate(layer.owner):
            for held, stored in zip(hybrid._expert(layer.held, s), hybrid._expert(layer.host, e), strict=True):
                assert torch.equal(held, stored)


def test_rebalance_holds_the_most_used_experts_and_copies_only_the_new_ones():
    model = load_model("tiny-v4", with_mtp=False, gpu_experts=2, device="cpu", dtype=torch.float64)
    layer = hybrid.hybrid_layers(model)[0]
    assert layer.owner == [0, 1] and layer.table.tolist()[:3] == [0, 1, -1]
    layer.uses.zero_()
    layer.uses[torch.tensor([5, 1, 3])] = torch.tensor([9, 7, 2])
    assert layer.rebalance() == 1  # 1 stays in its slot, 5 takes 0's
    assert layer.owner == [5, 1] and layer.table[5] == 0 and layer.table[0] == -1
    assert layer.uses.tolist()[5] == 4 and layer.pairs_held == 7 and layer.pairs == 18
    assert torch.equal(layer.held.w1[0], layer.host.w1[5])
    with torch.inference_mode():  # float experts: the split's sums differ from the unsplit ones by the order only
        ids = torch.tensor([[3, 9, 27, 81, 243, 7]])
        ref = load_model("tiny-v4", with_mtp=False, dtype=torch.float64)
        got, want = model(ids).logits, ref(ids).logits
        assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_gpu_experts_is_refused_where_it_means_nothing():
    for kw, message in ((dict(gpu_experts=3, device="cpu"), "gpu_experts: needs a CUDA device"),
                        (dict(gpu_experts=0), r"gpu_experts: must be an integer >= 1, got 0"),
                        (dict(gpu_experts=2, weight_memory="1GiB"), "cannot be combined with weight_memory"),
                        (dict(gpu_experts=2, tensor_parallel_size=2), "not of a sharded engine")):
        with pytest.raises(ConfigError, match=message):
            LLMEngine(EngineConfig(model="tiny-v41", **kw))
    with pytest.raises(ConfigError, match="gpu_experts: must be an integer >= 1"):
        load_model("tiny-v41", gpu_experts=-1)
    assert not any(isinstance(m.experts, hybrid.HybridExperts)
                   for m in load_model("tiny-v41", gpu_experts=8, with_mtp=False).modules() if isinstance(m, MoE))
