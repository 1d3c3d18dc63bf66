"""Tall float32 weights (the LM head) stored column-major for the decode step: same values, same logits."""

from __future__ import annotations

import copy

import torch
from torch import nn

from engine_helpers import make_engine, prompt_of, reference_greedy, run_greedy, use_cuda_buckets
from flashserve.config.model_config import config_from_dict
from flashserve.config.presets import preset_json
from flashserve.model import blas
from flashserve.model.init import random_init
from flashserve.model.transformer import Transformer
from flashserve.model.weight_layout import column_major_tall_weights, is_tall


def test_only_tall_float32_cpu_matrices_are_converted():
    model = nn.Sequential(nn.Linear(64, 32000, bias=False), nn.Linear(512, 512, bias=False),
                          nn.Linear(64, 32000, bias=False).to(torch.bfloat16))
    emb = nn.Embedding(32000, 64)
    tied = nn.Linear(64, 32000, bias=False)
    tied.weight = emb.weight
    model.append(tied)
    model.append(emb)
    before = [p.detach().clone() for p in model.parameters()]
    assert column_major_tall_weights(model) == ["0.weight"]
    assert model[0].weight.stride() == (1, 32000) and model[0].weight.shape == (32000, 64)
    assert model[1].weight.is_contiguous() and model[2].weight.is_contiguous() and emb.weight.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert column_major_tall_weights(model) == []  # already column-major
    assert not is_tall(torch.zeros(1000, 100)) and is_tall(torch.zeros(20000, 100))


def test_weights_read_as_panels_or_packed_are_left_alone():
    """A tall weight with bfloat16 panels stays row-major (its decode rows read the panels), and a module that is not
    an nn.Linear is not asked for its ``weight`` (a packed module decodes its whole matrix when it is)."""

    class Packed(nn.Module):
        @property
        def weight(self) -> torch.Tensor:
            raise AssertionError("weight decoded")

    paneled = nn.Linear(64, 32000, bias=False)
    paneled.register_buffer("weight" + blas.PANELS, torch.zeros(1), persistent=False)
    model = nn.Sequential(Packed(), paneled, nn.Linear(64, 32000, bias=False))
    assert column_major_tall_weights(model) == ["2.weight"]
    assert paneled.weight.is_contiguous()


@torch.inference_mode()
def test_column_major_head_gives_the_same_logits_and_tokens():
    raw = preset_json("tiny-v41")
    # a head tall and large enough to convert (20000 x 64); no engram (its token classes follow the vocabulary)
    raw["text_config"].update(vocab_size=20000, engram_layer_ids=[], engram_num_embeddings=[])
    cfg = config_from_dict(raw)
    model = random_init(Transformer(cfg, with_mtp=False), seed=3).float().eval()
    model.fake_quant = False
    ref = copy.deepcopy(model)  # never given to an engine: stays row-major
    engine = make_engine(model, "tiny-v41", dtype="float32", cache_dtype="float", exact_prefill=True)
    assert model.head.weight.stride() == (1, cfg.vocab_size)  # the engine stored it column-major
    assert ref.head.weight.is_contiguous()
    ids = torch.tensor([prompt_of(40, seed=2)])
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    prompts = [prompt_of(17, seed=5), prompt_of(30, seed=6)]
    assert run_greedy(engine, prompts, 12) == [reference_greedy(ref, p, 12) for p in prompts]


def _two_layer_model() -> Transformer:
    """Two layers of ``tiny-v41`` with a 20000 x 64 head (tall and large enough for the conversions here)."""
    raw = preset_json("tiny-v41")
    raw["text_config"].update(vocab_size=20000, engram_layer_ids=[], engram_num_embeddings=[], num_hidden_layers=2,
                              compress_ratios=[0, 2], kv_source_layer_ids=[1], index_source_layer_ids=[1],
                              candidate_source_layer_id=-1, num_nextn_predict_layers=0, dspark_target_layer_ids=[])
    model = random_init(Transformer(config_from_dict(raw), with_mtp=False), seed=3).float().eval()
    model.fake_quant = False
    return model


@torch.inference_mode()
def test_a_compiled_step_of_several_rows_multiplies_panel_copies_of_its_weights(monkeypatch):
    """An engine compiled for several rows on the CPU gives its float32 products panel copies (torch's ``mm``
    repacks the weight every call): the head, the routers, the mHC mixing; its greedy tokens equal an eager
    engine's and its logits agree to float32 rounding; weights of one input (the router and the shared expert's gate
    and up) share one copy. One row (``max_num_seqs=1``) and eager engines make no
    copy. A compiled step keeps the head row-major (inductor's one-row reduction kernels read it faster); only
    an eager step's engine stores it column-major."""
    from flashserve.engine.graphs import decode_step

    model = _two_layer_model()
    with monkeypatch.context() as m:  # the layouts are chosen before the warm-up: its compile is not needed here
        m.setattr(decode_step.DecodeStep, "warm_up", lambda self, rows=1, verify_rows=None: 0.0)
        make_engine(model, "tiny-v41", dtype="float32", max_num_seqs=1, enforce_eager=False, compile_backend="eager")
    assert blas.panels(model.head, "weight") is None
    assert model.head.weight.is_contiguous()
    ref = copy.deepcopy(model)
    eager = make_engine(ref, "tiny-v41", dtype="float32", max_num_seqs=2, enforce_eager=True)
    assert ref.head.weight.stride() == (1, ref.cfg.vocab_size)
    use_cuda_buckets(monkeypatch)  # one graph, not a batch-1 graph as well (~20 s of this test)
    compiled = make_engine(model, "tiny-v41", dtype="float32", max_num_seqs=2, enforce_eager=False,
                           compile_backend="eager")
    copied = {name[: -len(blas.PANELS)] for name, _ in model.named_buffers() if name.endswith(blas.PANELS)}
    assert {"head.weight", "layers.0.hc_attn_fn"} <= copied  # V4.1: no hc_head
    # the router shares one copy with the shared expert's gate and up (one input), and has none of its own
    assert model.layers[1].ffn.x_joint_of[0] == ("gate.weight", "shared_experts.w1.weight",
                                                 "shared_experts.w3.weight")
    assert "layers.1.ffn.gate.weight" not in copied
    assert not any(name.endswith(blas.PANELS) for name, _ in ref.named_buffers())
    assert set(model.checkpoint_tensors()) == set(ref.checkpoint_tensors())  # the copy is not a checkpoint tensor
    seen = {e: [] for e in (eager, compiled)}
    for e in seen:
        decode = e.runner.decode
        e.runner.decode = lambda seqs, d=decode, s=seen[e]: s.append(d(seqs)) or s[-1]
    prompts = [prompt_of(17, seed=5), prompt_of(30, seed=6)]
    assert run_greedy(compiled, prompts, 12) == run_greedy(eager, prompts, 12)
    assert len(seen[compiled]) == len(seen[eager]) > 0
    for a, b in zip(seen[compiled], seen[eager]):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5
