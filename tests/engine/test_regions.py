"""The compiled decode step as regions: layers of one kind share one compiled graph, called for each with its own
weights and cache (flashserve/engine/graphs/regions.py)."""

from __future__ import annotations

import torch

from engine_helpers import make_engine, prompt_of, run_greedy
from flashserve.config.model_config import config_from_dict
from flashserve.config.presets import preset_json, with_layout
from flashserve.engine.graphs.regions import RegionPlan, fingerprint, layer_relations, named_tensors
from flashserve.model.init import random_init
from flashserve.model.transformer import Transformer


def _model(raw: dict) -> Transformer:
    text = raw["text_config"]
    text.update(hc_sinkhorn_iters=3, num_nextn_predict_layers=0, dspark_target_layer_ids=[],
                compress_ratios=text["compress_ratios"][:text["num_hidden_layers"]])  # no MTP layers
    model = random_init(Transformer(config_from_dict(raw), with_mtp=False, with_vision=False), seed=2).float().eval()
    model.fake_quant = False
    return model


def _kinds(engine) -> list[str]:
    return sorted(call.name.split(" of ")[0] for call in engine.runner.decode_step.regions.kinds.values())


def test_forty_layers_compile_the_kinds_of_ten():
    """``tiny-v41``'s ten layers and the real model's forty (the same sizes) have the same kinds of layer region:
    six attention halves (window-only; ratio-2 sources and their readers; the ratio-1 source of the candidate
    pool, its re-indexing reader and their readers), two engrams (their tables differ in size) and one MoE half.
    Dynamo traces one graph a kind and batch bucket for forty layers as for ten, and the ten layers' greedy tokens
    equal their eager twin's (the forty call the same kinds' code)."""
    from torch._dynamo.utils import counters

    prompts = [prompt_of(40, seed=1), prompt_of(9, seed=2)]
    traced, kinds = [], []
    # the ten layers with batches of 1 and 2 (each kind's graph called for its other layers at a dynamic batch),
    # the forty with batch 1 only (half the tracing)
    for raw, seqs in ((preset_json("tiny-v41"), 2), (with_layout("tiny-v41", "deepseek-v41-flash"), 1)):
        kw = dict(dtype="float32", cache_dtype="packed", max_num_seqs=seqs)
        model = _model(raw)
        before = counters["stats"]["unique_graphs"]
        compiled = make_engine(model, "tiny-v41", enforce_eager=False, compile_backend="eager", **kw)
        traced.append(counters["stats"]["unique_graphs"] - before)
        kinds.append(_kinds(compiled))
        assert compiled.runner.decode_step.regions.planned()
        if seqs == 2:
            eager = make_engine(model, "tiny-v41", enforce_eager=True, **kw)
            assert run_greedy(compiled, prompts, 6) == run_greedy(eager, prompts, 6)
    assert kinds[0] == kinds[1] and kinds[0].count("attention") == 6
    assert kinds[0].count("engram") == 2 and kinds[0].count("feed-forward") == 1
    assert traced[0] == 2 * traced[1] == 2 * len(kinds[0])  # one graph a kind and batch bucket


def test_a_kind_is_what_its_graph_may_have_taken_as_a_constant():
    """Layers whose code would trace differently are of different kinds: another compression ratio, another
    place among the layers sharing caches (a source against its reader), an engram. The same role at another
    depth is the same kind."""
    model = _model(preset_json("tiny-v41"))
    cfg = model.cfg
    attn = [fingerprint(b.attn) for b in model.layers]
    assert attn[3] == attn[5] and attn[7] == attn[9]  # ratio-2 readers; ratio-1 readers
    assert attn[2] != attn[6]  # ratio 2 against ratio 1
    assert layer_relations(cfg, 2) != layer_relations(cfg, 3)  # the source and its reader
    assert layer_relations(cfg, 3) == layer_relations(cfg, 5)
    assert layer_relations(cfg, 7) != layer_relations(cfg, 3)  # a reader of the candidate pool's layers
    assert fingerprint(model.layers[0]) != fingerprint(model.layers[1])  # layer 1 has an engram (a region of its own)
    model.layers[5].attn.window += 1
    assert fingerprint(model.layers[5].attn) != attn[3]


def test_tensors_are_named_alike_in_objects_alike():
    """Each instance's tensors get the same names, so a graph's arguments move from one layer to another."""
    model = _model(preset_json("tiny-v41"))
    a, b = named_tensors(model.layers[3], "block"), named_tensors(model.layers[5], "block")
    assert a.keys() == b.keys() and len(a) > 20
    assert a["block.attn.wq_a.weight"] is model.layers[3].attn.wq_a.weight
    assert all(a[k].shape == b[k].shape and a[k] is not b[k] for k in a)


def test_a_graph_is_shared_only_where_every_argument_has_a_place():
    """A graph argument that is another layer's tensor (not the instance's, not an input) cannot be moved to
    another instance: no plan, so each instance runs through dynamo. Shared tensors (owned by no layer) stay."""
    from flashserve.engine.graphs.graph_call import GraphRecorder

    own, other, shared = torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 3.0)
    recorder = GraphRecorder("eager", {})

    def region(x):
        return x * own + shared, x * other

    x = torch.arange(3.0)
    result = torch.compile(region, backend=recorder)(x)
    call = recorder.calls[-1]
    names = {id(own): "own"}
    plan = RegionPlan.make(call, (x,), ("x",), result, names, foreign=set())
    bound = plan.bind({"own": torch.full((3,), 5.0)})
    y = torch.tensor([1.0, 2.0, 4.0])
    first, second = bound((y,))
    assert torch.equal(first, y * 5 + 3) and torch.equal(second, y * 2)  # `other` is shared: no layer owns it
    assert RegionPlan.make(call, (x,), ("x",), result, names, foreign={id(other)}) is None
    assert plan.bind({}) is None  # an instance without the tensor


def test_the_compile_cache_is_where_inductor_keeps_the_step(tmp_path, monkeypatch, caplog):
    """``compile_cache`` points inductor at a folder of the user's (kept for later starts), and the engine's
    start-up log names what it compiles: the kinds, the layers they serve and that folder."""
    import logging
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", cache_dir()))
    model = _model(preset_json("tiny-v41"))
    with caplog.at_level(logging.INFO, logger="flashserve.engine"):
        engine = make_engine(model, "tiny-v41", enforce_eager=False, compile_backend="eager", dtype="float32",
                             max_num_seqs=1, compile_cache=str(tmp_path / "kernels"))
    assert cache_dir() == str(tmp_path / "kernels") and (tmp_path / "kernels").is_dir()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling the decode step")]
    assert said == ["compiling the decode step for batches [1]: 9 kinds of layer region (engram, attention, MoE) "
                    "for 10 layers, a prologue and an epilogue (eager)"]
    engine.runner.decode_step.regions.backend = "inductor"
    assert str(tmp_path / "kernels") in engine.runner.decode_step.regions.describe()


def test_saved_graphs_are_named_by_the_model_and_the_cache_they_were_compiled_for(tmp_path):
    """A graph saved for one cache layout or model is never loaded for another: the window ring an engine keeps
    rows for drafts in is longer with speculation than without, and a graph compiled for one took its length as a
    constant (loaded for the other, a compiled kernel's bounds check aborted the process). Two engines built alike
    name their graphs alike, so a later start still loads what an earlier one saved."""
    from flashserve.engine.graphs.graph_call import GraphRecorder
    from flashserve.engine.graphs.regions import RegionalStep
    from flashserve.engine.graphs.step_artifacts import StepArtifacts

    def names(model, name, **kw) -> list[str]:
        kw = {"dtype": "float32", "cache_dtype": "packed", "max_num_seqs": 2, **kw}
        engine = make_engine(model, name, **kw)
        regions = RegionalStep(engine.model, engine.cache, torch.compile, GraphRecorder("eager", {}))
        return [kind for kind, _ in StepArtifacts(regions, tmp_path)._kinds]

    v41 = _model(preset_json("tiny-v41"))
    ngram = {"method": "ngram", "num_speculative_tokens": 4}  # rows kept for 4 drafts
    plain = names(v41, "tiny-v41")
    assert names(v41, "tiny-v41") == plain
    spec = names(v41, "tiny-v41", speculative_config=ngram)
    assert len(spec) == len(plain) and not set(spec) & set(plain)
    assert not set(names(v41, "tiny-v41", max_num_seqs=3)) & set(plain)  # slots: another cache layout
    other = preset_json("tiny-v41")
    other["text_config"]["rms_norm_eps"] = 1e-6  # another model: its epilogue's norm differs too
    assert not set(names(_model(other), "tiny-v41")) & set(plain)
