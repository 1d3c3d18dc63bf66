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
from flashserve.model.moe import Experts, MoE


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
    layers = hybrid.hybrid_layers(model)
    layer = layers[0]
    assert layer.owner == [0, 1] and layer.table.tolist()[:3] == [0, 1, -1]
    assert layer.rebalance() == 0 and layer.owner == [0, 1]  # no counts: ties keep the held experts
    layer.uses[torch.tensor([5, 1, 3])] = torch.tensor([9, 7, 2])
    assert layer.rebalance() == 1  # 1 stays in its slot, 5 takes 0's
    assert layer.owner == [5, 1] and layer.table[5] == 0 and layer.table[0] == -1
    assert layer.uses.tolist()[5] == 4
    assert torch.equal(layer.held.w1[0], layer.host.w1[5])
    routed = {}

    def count(m, args):  # the step's routing of the layers not rebalanced by hand
        routed[m] = torch.bincount(args[1].flatten(), minlength=m.n_experts)

    for other in layers[1:]:
        other.register_forward_pre_hook(count)
    with torch.inference_mode():  # float experts: the split's sums differ from the unsplit ones by the order only
        ids = torch.tensor([[3, 9, 27, 81, 243, 7]])
        ref = load_model("tiny-v4", with_mtp=False, dtype=torch.float64)
        got, want = model(ids).logits, ref(ids).logits
        assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    for other, counts in routed.items():  # the first step ran on the experts it routed most pairs to
        held = counts[other.owner]
        assert held.min() >= counts[(other.table < 0)].max() and held.min() > 0, (other.owner, counts)
    assert len(routed) == len(layers) - 1 and any(other.owner != [0, 1] for other in routed)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert all(m.experts.pairs == ids.numel() * m.gate.top_k for m in moes)  # every pair counted once, where it ran
    assert 0 < hybrid.hybrid_stats(layers)["held_share"] <= 1


def _experts(n: int = 8, dim: int = 16, inter: int = 8) -> Experts:
    """Float64 experts of random weights."""
    g = torch.Generator().manual_seed(7)
    experts = Experts(n, dim, inter, 10.0).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return experts


def test_the_routing_is_copied_to_the_host_before_the_device_experts_run(monkeypatch):
    """Each step copies its activations, routing indices and weights to the host first, then launches the held
    experts, then computes the others on the host; the sums are the unsplit experts'; the staging buffers are
    reused by smaller steps and grown by larger ones."""
    layer = hybrid.HybridExperts(_experts(), 3)
    layer.place([0, 1, 2])
    events = []
    fetch = layer.staging.fetch

    def recorded_fetch(*tensors):
        out = fetch(*tensors)
        events.append(("copied", [t.clone() for t in out]))
        return out

    def recorded_products(*args):
        events.append(("device", None))
        return products(*args)

    products = layer.held.expert_mm
    monkeypatch.setattr(layer.staging, "fetch", recorded_fetch)
    monkeypatch.setattr(layer.held, "expert_mm", recorded_products)
    layer.host.register_forward_pre_hook(lambda m, args: events.append(("host", None)))
    g = torch.Generator().manual_seed(3)
    grown = []
    for T in (5, 2, 7):
        x = torch.randn(T, 16, generator=g, dtype=torch.float64)
        idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])  # 4+ experts, 3 slots: both sides
        w = torch.rand(T, 2, generator=g, dtype=torch.float64)
        events.clear()
        got = layer(x, idx, w)
        order = [e for i, (e, _) in enumerate(events) if i == 0 or events[i - 1][0] != e]
        assert order == ["copied", "device", "host"]
        assert all(torch.equal(a, b) for a, b in zip(events[0][1], (x, idx, w), strict=True))
        want = layer.host(x, idx, w)
        assert (got - want).abs().max() <= 1e-12 * want.abs().max()
        grown.append(layer.staging.grown)
    assert grown[1] == grown[0] < grown[2]  # the second step reused the first's buffers, the third needed more
    assert not any(t.is_pinned() for t in layer.staging.buffers.values())  # pinning is for CUDA devices


def _route(counts: dict[int, int]) -> torch.Tensor:
    """One pair a token (top-1), expert e routed counts[e] times."""
    return torch.tensor([e for e, n in counts.items() for _ in range(n)])[:, None]


@pytest.mark.parametrize("rebalance_steps", [256, 4])
def test_a_layer_holds_the_most_used_experts_from_its_first_step(monkeypatch, rebalance_steps):
    """The routing prefers high-id experts: the first step already runs on them (placed from its own counts), the
    placement follows the traffic at steps 2 and 4 (the growing schedule) but not at step 3; from REBALANCE_STEPS
    on the engine's rebalance moves it."""
    monkeypatch.setattr(hybrid, "REBALANCE_STEPS", rebalance_steps)
    layer = hybrid.HybridExperts(_experts(), 2)
    layer.place([0, 1])
    g = torch.Generator().manual_seed(5)

    def step(counts: dict[int, int]) -> set[int]:
        idx = _route(counts)
        x = torch.randn(len(idx), 16, generator=g, dtype=torch.float64)
        w = torch.rand(len(idx), 1, generator=g, dtype=torch.float64)
        got, want = layer(x, idx, w), layer.host(x, idx, w)
        assert (got - want).abs().max() <= 1e-12 * want.abs().max()
        return set(layer.owner)

    assert step({6: 3, 7: 2, 0: 1}) == {6, 7}  # step 1: placed from its own routing before it ran
    assert (layer.pairs_held, layer.pairs) == (5, 6)
    assert step({3: 4, 4: 4, 6: 1}) == {3, 4}  # step 2: counts 3: 4, 4: 4, 6: 1 + 3 // 2
    assert step({5: 9, 2: 9}) == {3, 4}  # step 3: no rebalance
    assert (layer.pairs_held, layer.pairs) == (5 + 8, 6 + 9 + 18)
    if rebalance_steps > 4:
        assert step({1: 1}) == {2, 5}  # step 4: 2 and 5 (9 each) over 3 and 4 (2 each)
    else:  # step 4 is the engine's to rebalance
        assert step({1: 1}) == {3, 4}
        assert hybrid.rebalance([layer]) == 2 and set(layer.owner) == {2, 5}
    assert layer.copied == 2 + 2 + 2 + 2  # loaded 0 and 1, then two a move
    for s, e in enumerate(layer.owner):
        assert all(torch.equal(a, b) for a, b in zip(hybrid._expert(layer.held, s), hybrid._expert(layer.host, e)))


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
