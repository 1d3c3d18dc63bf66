"""The fixed-shape decode step: equal to the dynamic path, compiled equal to eager, no host syncs inside,
no recompiles in steady state.

Compiling the presets with inductor takes minutes on a 2-core CPU, so the compiled checks run on a compact
V4.1 (five layers with every role: window-only, ratio-2 KV+index source, ratio-2 reader, ratio-1 source with
the candidate pool, re-index; engram on; three Sinkhorn iterations) through dynamo's ``eager`` backend (the
same graph capture and guards, no code generation) for the matrix and the recompile count, and inductor once
for the numbers, on two of those layers (window-only, ratio-2 source).
"""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch

from engine_helpers import dynamic_decode, make_engine, prompt_of, run_greedy, use_cuda_buckets
from flashserve.config.engram_primes import engram_table_rows
from flashserve.config.model_config import config_from_dict
from flashserve.config.presets import preset_json
from flashserve.engine import SamplingParams
from flashserve.engine.graphs.regions import named_tensors
from flashserve.model import cpu_kernels
from flashserve.model.init import random_init
from flashserve.model.packed import pack_model, plan
from flashserve.model.transformer import Transformer


# five layers with every role; three (window-only, ratio-2 source, ratio-1 source with the candidate pool) for
# the 200-step recompile check; two where inductor compiles for real, as its cold compile grows with the graph
COMPACT = dict(num_hidden_layers=5, compress_ratios=[0, 2, 2, 1, 1], kv_source_layer_ids=[1, 3],
               index_source_layer_ids=[1, 3, 4], candidate_source_layer_id=3)
TWO = dict(num_hidden_layers=2, compress_ratios=[0, 2], kv_source_layer_ids=[1], index_source_layer_ids=[1],
           candidate_source_layer_id=-1)
SMALL = dict(num_hidden_layers=3, compress_ratios=[0, 2, 1], kv_source_layer_ids=[1, 2],
             index_source_layer_ids=[1, 2], candidate_source_layer_id=2)


def compact_v41(dtype: torch.dtype, quantization: str | None = None, layers: dict = COMPACT) -> Transformer:
    raw = preset_json("tiny-v41")
    raw["text_config"].update(
        **layers, engram_layer_ids=[1],
        engram_num_embeddings=engram_table_rows(1, max_ngram=4, n_heads=2, vocab_size=1000),
        hc_sinkhorn_iters=3, num_nextn_predict_layers=0, dspark_target_layer_ids=[])
    cfg = config_from_dict(raw)
    model = random_init(Transformer(cfg, with_mtp=False), seed=1).to(dtype).eval()
    if quantization:
        pack_model(model, plan(cfg, quantization), quantize=True, compute_dtype=dtype)
    model.fake_quant = False
    return model


def compact_v4(seed: int) -> Transformer:
    """``tiny-v4`` cut to three float32 layers, one of each kind: window, CSA (ratio 4) and HCA (ratio 128)."""
    raw = preset_json("tiny-v4")
    raw.update(num_hidden_layers=3, compress_ratios=[0, 4, 128], num_hash_layers=1, hc_sinkhorn_iters=3,
               num_nextn_predict_layers=0)
    model = random_init(Transformer(config_from_dict(raw), with_mtp=False), seed=seed).float().eval()
    model.fake_quant = False
    return model


def _recording(engine) -> list[torch.Tensor]:
    """Record the logits of every decode step the engine runs."""
    seen, decode = [], engine.runner.decode
    engine.runner.decode = lambda seqs: seen.append(decode(seqs)) or seen[-1]
    return seen


def _staggered(engine, n: int = 3, tokens: int = 10) -> list[list[int]]:
    """Requests that join one step apart, so decode batches of 1, 2 and 3 (between buckets) all occur."""
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    done, added = {}, 0
    while added < n or engine.has_unfinished_requests():
        if added < n:
            engine.add_request(f"r{added}", prompt_of(9 + 11 * added, seed=added), sp)
            added += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(n)]


@pytest.mark.parametrize("name,cache_dtype", [("tiny-v4", "float"), ("tiny-v41", "packed")])
def test_fixed_step_equals_dynamic_path(models, name, cache_dtype):
    model = models(name)  # float64
    prompts = [prompt_of(n, seed=n) for n in (5, 40, 77)]
    fixed = make_engine(model, name, cache_dtype=cache_dtype)
    dynamic = make_engine(model, name, cache_dtype=cache_dtype)
    dynamic.runner.decode = dynamic_decode(dynamic.runner)
    a_logits, b_logits = _recording(fixed), _recording(dynamic)
    assert run_greedy(fixed, prompts, 12) == run_greedy(dynamic, prompts, 12)
    for a, b in zip(a_logits, b_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fixed_step_picks_packed_index_entries_in_the_kernel_as_the_dynamic_path_does(models, monkeypatch):
    """float32 tiny-v41 with its FP4 index cache: the fixed-shape step's indexers run ``cpu_kernels.index_topk``
    (every visible entry, the candidate pool, then only the pool's entries), the dynamic path the torch code.
    Prompts reach past the top-k and the pool, so what is picked matters: the same greedy tokens and logits."""
    from flashserve.model import attention

    calls, kernel = [], cpu_kernels.index_topk
    monkeypatch.setattr(attention.cpu_kernels, "index_topk",
                        lambda *a: calls.append("listed" if a[5].shape[1] else "pool" if a[8] else "all") or kernel(*a))
    model = models("tiny-v41", torch.float32)
    assert model.fake_quant  # queries and keys FP4-rounded: the kernel's integer products
    prompts = [prompt_of(n, seed=n) for n in (5, 40, 150)]
    fixed = make_engine(model, "tiny-v41", dtype="float32", cache_dtype="packed")
    dynamic = make_engine(model, "tiny-v41", dtype="float32", cache_dtype="packed")
    dynamic.runner.decode = dynamic_decode(dynamic.runner)
    a_logits, b_logits = _recording(fixed), _recording(dynamic)
    tokens = run_greedy(fixed, prompts, 12)
    made = len(calls)
    assert tokens == run_greedy(dynamic, prompts, 12) and len(calls) == made
    assert {"all", "pool", "listed"} <= set(calls)
    for a, b in zip(a_logits, b_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# float64 on every role (COMPACT) holds the graphs to 1e-12; float32 with float weights, the dtype users run, on two
# layers (window-only, ratio-2 source; each layer's products of one input in one call, blas.joint_products), and on
# three for 120 steps in test_no_recompiles_after_warm_up. w8a8's experts are int8 (the gathered path), its dense
# layers fbgemm's kernel op (int8's dense products compiled: test_packed); mxfp4's experts go through the C++
# kernel's op in both engines, its dense products through stream panels. The packed formats run CUDA's buckets (one
# graph, a lone request padded to 2 rows): the batch-1 graph is tested by the float cases here and by inductor's
# test below
@pytest.mark.parametrize("dtype,cache_dtype,weights,layers", [(torch.float64, "float", None, COMPACT),
                                                             (torch.float32, "float", None, TWO),
                                                             (torch.float32, "packed", "w8a8", TWO),
                                                             (torch.float32, "packed", "mxfp4", TWO)])
def test_compiled_graph_equals_eager(monkeypatch, dtype, cache_dtype, weights, layers):
    if weights is not None:
        use_cuda_buckets(monkeypatch)
    if weights == "mxfp4":  # its float32 dense weights through stream panels, as an AVX2 CPU gives a large weight
        monkeypatch.setattr(cpu_kernels, "STREAM_MIN_BYTES", 0)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    model = compact_v41(dtype, weights, layers)
    name = "tiny-v41"
    kw = dict(dtype=str(dtype).removeprefix("torch."), cache_dtype=cache_dtype, max_num_seqs=4)
    eager = make_engine(model, name, enforce_eager=True, **kw)
    compiled = make_engine(model, name, enforce_eager=False, compile_backend="eager", **kw)
    a_logits, b_logits = _recording(eager), _recording(compiled)
    assert _staggered(eager) == _staggered(compiled)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(a_logits, b_logits, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= tol


def test_compiled_v4_step_with_joint_products_equals_eager():
    """V4 in float32 with float weights (the layout of the benchmark's peers checkpoint): a CSA layer's seven
    products of its rows (two compressors and the indexer's weights) and two of its query latent, an HCA layer's
    four, each in one call of the compiled step (dynamo's ``eager`` backend); greedy tokens equal the eager
    engine's, logits within 1e-5 relative."""
    model = compact_v4(seed=2)
    kw = dict(dtype="float32", cache_dtype="float", max_num_seqs=4)
    eager = make_engine(model, "tiny-v4", enforce_eager=True, **kw)
    compiled = make_engine(model, "tiny-v4", enforce_eager=False, compile_backend="eager", **kw)
    groups = {g for m in model.modules() for g in ("x", "qr") if hasattr(m, f"{g}_joint_panels")}
    assert groups == {"x", "qr"} and len(model.layers[1].attn.x_joint_of[0]) == 7
    a_logits, b_logits = _recording(eager), _recording(compiled)
    assert _staggered(eager) == _staggered(compiled)
    for a, b in zip(a_logits, b_logits, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5


def test_a_one_row_int8_step_multiplies_each_inputs_int8_weights_in_one_call(monkeypatch):
    """Where one-row int8 products take the int8 kernel (monkeypatched on, as on AVX2-only CPUs), a compiled
    engine stores the int8 weights of one input one after another and makes their products in one call: the
    attention's ``wq_a`` and ``wkv``, its query latent's two ``wq_b``, the shared expert's gate and up; the
    routed experts' gate and up take one call too (in both engines; tests/model/test_cpu_kernels.py compares it
    with two calls). Its logits equal, bit for bit, those of the same engine with one call a weight, and its
    greedy tokens the eager engine's; its checkpoint names are the same."""
    from flashserve.engine import execution

    monkeypatch.setattr(cpu_kernels, "int8_pairs_preferred", lambda: True)
    calls = {"int8_pairs": [], "int8_gate_up": []}
    for op, seen in calls.items():
        real = getattr(cpu_kernels, op)
        monkeypatch.setattr(cpu_kernels, op, lambda *a, real=real, seen=seen: seen.append(a[2].shape[1]) or real(*a))
    kw = dict(dtype="float32", cache_dtype="packed", max_num_seqs=1)
    with monkeypatch.context() as m:
        m.setattr(execution, "join_int8_rows", lambda model: [])
        apart = make_engine(compact_v41(torch.float32, "int8", TWO), "tiny-v41", enforce_eager=False,
                            compile_backend="eager", **kw)
    traced_apart = {k: list(v) for k, v in calls.items()}
    for v in calls.values():
        v.clear()
    model = compact_v41(torch.float32, "int8", TWO)
    joined = make_engine(model, "tiny-v41", enforce_eager=False, compile_backend="eager", **kw)
    attn, ffn = model.layers[1].attn, model.layers[1].ffn
    assert attn.x_joint_int8_of[0] == ("wq_a.weight", "wkv.weight")
    assert attn.qr_joint_int8_of[0] == ("wq_b.weight", "indexer.wq_b.weight")
    assert ffn.x_joint_int8_of[0] == ("shared_experts.w1.weight", "shared_experts.w3.weight")
    assert attn.wkv.packed.qweight.data_ptr() == attn.x_joint_int8_q[attn.wq_a.out_features].data_ptr()
    assert set(model.checkpoint_tensors()) == set(apart.model.checkpoint_tensors())  # the rows are no checkpoint tensor
    groups = [getattr(mod, f"{g}_joint_int8_of")[1] for mod in model.modules() for g in ("x", "qr")
              if hasattr(mod, f"{g}_joint_int8_of")]
    assert len(groups) == 5  # each a call where its weights took one each
    # each kind of region is traced once, through its first layer: the two layers' MoE halves are one kind
    traced = [mod for call in joined.runner.decode_step.regions.kinds.values() if call.name[0] in "af"
              for mod in getattr(call.representative[1][-1], "attn" if call.name[0] == "a" else "ffn").modules()]
    traced_groups = [getattr(mod, f"{g}_joint_int8_of")[1] for mod in traced for g in ("x", "qr")
                     if hasattr(mod, f"{g}_joint_int8_of")]
    assert len(traced_groups) == 4
    assert len(traced_apart["int8_pairs"]) - len(calls["int8_pairs"]) == sum(len(w) - 1 for w in traced_groups)
    assert {sum(w) for w in groups} <= set(calls["int8_pairs"])
    assert len(calls["int8_gate_up"]) == len(traced_apart["int8_gate_up"]) == 1  # the MoE kind's gate and up
    a_logits, b_logits = _recording(apart), _recording(joined)
    prompts = [prompt_of(23, seed=4)]
    got = run_greedy(joined, prompts, 10)
    assert got == run_greedy(apart, prompts, 10)
    assert len(a_logits) == len(b_logits) > 0 and all(torch.equal(a, b) for a, b in zip(a_logits, b_logits))
    eager = make_engine(compact_v41(torch.float32, "int8", TWO), "tiny-v41", enforce_eager=True, **kw)
    assert run_greedy(eager, prompts, 10) == got


def test_v4_step_reads_the_pages_its_requests_hold():
    """A V4 step reads as many pages as its longest request holds, two at least: enough for the CSA indexer's
    top-k, whose cache gets 32 entries a page. The HCA caches get one entry a page but pick no top-k, so they do
    not set the width (they once made every step read ``index_topk`` pages). Contexts growing from 2 to 3 pages
    compile nothing after the warm-up, and the logits equal the eager engine's."""
    from torch._dynamo.utils import counters

    model = compact_v4(seed=3)
    kw = dict(dtype="float32", cache_dtype="float", max_num_seqs=2)
    compiled = make_engine(model, "tiny-v4", enforce_eager=False, compile_backend="eager", **kw)
    assert compiled.cache.page_tokens == 128 and model.cfg.index_topk > 2
    graphs = counters["stats"]["unique_graphs"]
    step_fn, widths = compiled.runner.decode_step._forward, []
    compiled.runner.decode_step._forward = lambda ids, st, sl, table: widths.append(table.shape[1]) or step_fn(
        ids, st, sl, table)
    prompts = [prompt_of(240, seed=1), prompt_of(120, seed=2)]  # 2 pages, then 3; 1 page, then 2
    b_logits = _recording(compiled)
    got = run_greedy(compiled, prompts, 24)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sorted(set(widths)) == [2, 3]
    eager = make_engine(model, "tiny-v4", enforce_eager=True, **kw)
    a_logits = _recording(eager)
    assert run_greedy(eager, prompts, 24) == got
    for a, b in zip(a_logits, b_logits, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5


def test_inductor_step_equals_eager(caplog):
    """The compiled step as users run it (inductor, its C++ wrapper on the CPU): greedy tokens equal, logits
    within 1e-5 relative in float32, the compile time logged. One request at a time, so one graph per region
    kind: the batch-2+ graphs are the same code with a dynamic batch (checked above through dynamo's ``eager``
    backend). The regions' C++ wrappers do not check their inputs' sizes and strides at every call, take a layer's
    weights as a buffer per dtype, and every region is called directly: dynamo runs only a kind's first layer,
    once for each new input shape."""
    from torch._inductor.utils import run_and_get_code

    model = compact_v41(torch.float32, layers=TWO)
    kw = dict(dtype="float32", cache_dtype="packed", max_num_seqs=1)
    eager = make_engine(model, "tiny-v41", enforce_eager=True, **kw)
    with caplog.at_level(logging.INFO, logger="flashserve.engine"), \
            torch._inductor.config.patch(fx_graph_cache=False):  # generated now, so its code can be read
        compiled, code = run_and_get_code(make_engine, model, "tiny-v41", enforce_eager=False, **kw)
    assert any("decode step compiled" in r.getMessage() for r in caplog.records)
    wrapper = "\n".join(code)
    assert "inductor_entry_impl" in wrapper and "cpp_fused" in wrapper
    assert "assert_size_stride(" not in wrapper
    step = compiled.runner.decode_step
    assert step.warmup_s > 0 and step.regions.planned()
    # each region takes its layer's weights as one buffer per dtype: at most a region's 11 inputs, two
    # buffers and the cache's tensors, fewer inputs than one layer has weights
    handles = [int(n) for n in re.findall(r"raii_handles\(input_handles, (\d+)\)", wrapper)]
    cache = len(named_tensors(step.cache.storage, "cache"))
    assert len(handles) == len(step.regions.kinds) and max(handles) <= 11 + 2 + cache
    assert 11 + 2 + cache < len(named_tensors(model.layers[1], "layer"))
    # prologue, epilogue, two attention kinds (window-only, compressed), layer 1's engram, one MoE kind for both
    assert len(step.regions.kinds) == 6
    through_dynamo = []
    for call in step.regions.kinds.values():
        call.compiled = lambda *a, call=call, real=call.compiled: through_dynamo.append(call.name) or real(*a)
    a_logits, b_logits = _recording(eager), _recording(compiled)
    assert _staggered(eager) == _staggered(compiled)
    for a, b in zip(a_logits, b_logits, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5
    # a new table width goes through dynamo once per kind (through its first layer), later steps call directly
    assert len(through_dynamo) < len(b_logits) * len(step.regions.kinds)
    assert set(through_dynamo) <= {call.name for call in step.regions.kinds.values()}
    assert len(through_dynamo) % len(step.regions.kinds) == 0


def test_cpu_step_runs_inductors_cpp_wrapper_unless_an_op_takes_a_python_object(monkeypatch):
    """The C++ wrapper (1.4x at batch 1 on the benchmark's checkpoint) for every CPU step inductor compiles,
    except w8a8's, whose kernel op takes a Python object the C++ wrapper cannot pass."""
    from flashserve.engine.graphs import decode_step, graph_call

    seen = []
    monkeypatch.setattr(decode_step.torch, "compile", lambda fn, **kw: seen.append(kw["backend"]) or fn)
    kw = dict(dtype="float32", cache_dtype="packed", max_num_seqs=2, enforce_eager=False)
    engines = []
    for weights, backend in ((None, "inductor"), ("mxfp4", "inductor"), ("w8a8", "inductor"), (None, "eager")):
        seen.clear()
        make_engine(compact_v41(torch.float32, weights, TWO), "tiny-v41", compile_backend=backend, **kw)
        # every region kind of an engine compiles through the step's recording backend, which holds the options
        assert seen and all(isinstance(b, graph_call.GraphRecorder) and b is seen[0] for b in seen)
        engines.append((seen[0].backend, seen[0].options.get("cpp_wrapper", False)))
    assert engines == [("inductor", True), ("inductor", True), ("inductor", False), ("eager", False)]


def _random_traffic(engine, steps: int = 120) -> set[int]:
    """Requests joining and leaving at random for ``steps`` steps (the same schedule for every engine);
    returns the decode batch sizes seen."""
    rng, sizes = random.Random(0), set()
    for step in range(steps):
        if rng.random() < 0.3 and len(engine.scheduler.running) < 8:
            sp = SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True)
            engine.add_request(f"r{step}", prompt_of(rng.randint(3, 60), seed=step), sp)
        sizes.add(sum(s.prefill_done for s in engine.scheduler.running))
        engine.step()
    return sizes


def test_no_recompiles_after_warm_up():
    """120 steps of requests joining and leaving at random (batch sizes across every bucket, contexts
    growing across pages) compile nothing after the warm-up, and give the eager step's logits (float32,
    packed cache) to 1e-5 relative at every step."""
    from torch._dynamo.utils import counters

    model = compact_v41(torch.float32, layers=SMALL)
    # a float cache: over 200 steps a packed cache's FP8 rounding flips on the 1e-7 differences that padding
    # makes in the matmuls (seen: 3e-4 on one row), so the 1e-5 bound holds for the arithmetic, not the format
    kw = dict(dtype="float32", cache_dtype="float", max_num_seqs=8, block_size=16)
    engine = make_engine(model, "tiny-v41", enforce_eager=False, compile_backend="eager", **kw)
    graphs = counters["stats"]["unique_graphs"]
    step_fn, padded = engine.runner.decode_step._forward, []
    engine.runner.decode_step._forward = lambda ids, *a: padded.append(ids.shape[0]) or step_fn(ids, *a)
    compiled_logits = _recording(engine)
    sizes = _random_traffic(engine)
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(sizes) >= 5
    # batches are padded to buckets, except that a lone request runs one row (a 2-row matmul costs ~2x)
    assert 1 in sizes and set(padded) <= {1, 2, 4, 8} and {1, 8} <= set(padded) and 3 not in padded

    eager = make_engine(model, "tiny-v41", enforce_eager=True, **kw)
    eager_logits = _recording(eager)
    assert _random_traffic(eager) == sizes
    for a, b in zip(eager_logits, compiled_logits, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5


def test_without_a_one_row_graph_a_lone_request_is_padded_into_the_shared_graph(monkeypatch):
    """On CUDA the step keeps no graph for batch 1 (a second graph doubled a GPU engine's start-up): a lone
    request runs padded to 2 rows through the graph every batch shares, with eager's tokens. Imitated on the
    CPU by taking the buckets CUDA gets."""
    from torch._dynamo.utils import counters

    from flashserve.engine.graphs import decode_step

    assert decode_step.decode_buckets(16, one_row_graph=False) == [2, 4, 8, 16]
    assert decode_step.decode_buckets(1, one_row_graph=False) == [1]  # one request at most: its own graph
    use_cuda_buckets(monkeypatch)
    model = compact_v41(torch.float32, layers=TWO)
    kw = dict(dtype="float32", cache_dtype="float", max_num_seqs=4)
    before = counters["stats"]["unique_graphs"]
    engine = make_engine(model, "tiny-v41", enforce_eager=False, compile_backend="eager", **kw)
    assert engine.runner.decode_step.buckets == [2, 4]
    step_fn, padded = engine.runner.decode_step._forward, []
    engine.runner.decode_step._forward = lambda ids, *a: padded.append(ids.shape[0]) or step_fn(ids, *a)
    prompts = [prompt_of(9, 1)]
    got = run_greedy(engine, prompts, 6)
    assert padded and set(padded) == {2}
    assert counters["stats"]["unique_graphs"] - before == len(engine.runner.decode_step.regions.kinds)  # one a kind
    assert got == run_greedy(make_engine(model, "tiny-v41", enforce_eager=True, **kw), prompts, 6)


@pytest.mark.parametrize("signature", ["as installed", "without isolate_recompiles"])
def test_each_compiled_method_keeps_its_own_graphs(monkeypatch, signature):
    """Every compiled engine in a process (a benchmark, a notebook) runs the same step code, whose graphs dynamo
    caps per code object (8 by default): shared, a later engine's step would run eager without a word once
    earlier engines had used the cap up. ``compile_own_graphs`` keeps each method's graphs apart: with a cap of
    one, two objects whose methods need a graph each still get them. Where ``torch.compile`` has no
    ``isolate_recompiles`` (torch 2.11, as on the lent GPU machines; imitated here) it runs a copy of the
    method's code."""
    from flashserve.engine.graphs import decode_step

    real, graphs = torch.compile, []

    def older(model, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None):
        return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    class Scale:
        def __init__(self, k: int):
            self.k = k

        def forward(self, x):
            return x * self.k  # a constant of the graph: another object's k needs another graph

    if signature != "as installed":
        monkeypatch.setattr(torch, "compile", older)
    monkeypatch.setattr(decode_step, "GRAPHS_PER_STEP", 1)
    x = torch.ones(3)
    # torch's own patch, not monkeypatch: a config entry is no attribute of the module's __dict__, so pytest
    # (9.2 on) undoes a monkeypatch of it by deleting it, which hides the entry for the rest of the process
    with torch._dynamo.config.patch(recompile_limit=1):
        for k in (2, 3):
            assert decode_step.compile_own_graphs(Scale(k).forward, backend=backend)(x).tolist() == [k] * 3
    assert len(graphs) == 2


class HostSync(AssertionError):
    pass


def _forbid(*_args, **_kwargs):
    raise HostSync("a value was read back to the host inside the decode step")


def _no_host_sync(fn, monkeypatch):
    """``fn`` run with every tensor-to-Python conversion patched to raise."""
    def guarded(*args):
        with monkeypatch.context() as m:
            for attr in ("item", "tolist", "nonzero", "__int__", "__float__", "__bool__", "__index__", "numpy"):
                m.setattr(torch.Tensor, attr, _forbid)
            m.setattr(torch, "nonzero", _forbid)
            return fn(*args)
    return guarded


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_decode_step_does_not_sync_with_the_host(models, name, monkeypatch):
    """Inside the step's forward nothing converts a tensor to a Python value; the dynamic path does (so the
    guard can fail)."""
    engine = make_engine(models(name, torch.float32), name, dtype="float32")
    step = engine.runner.decode_step
    sizes = []
    forward = step._eager  # the fixed-shape step, eager (make_engine's default)
    step._eager = _no_host_sync(lambda *a: sizes.append(a[0].shape[0]) or forward(*a), monkeypatch)
    prompts = [prompt_of(n, seed=n) for n in (30, 70, 133)]
    run_greedy(engine, prompts, 8)
    assert max(sizes) == 3

    dynamic = make_engine(models(name, torch.float32), name, dtype="float32")
    dynamic.runner.decode = _no_host_sync(dynamic_decode(dynamic.runner), monkeypatch)
    with pytest.raises(HostSync):
        run_greedy(dynamic, prompts, 2)


def _decoding(engine, prompts: list[list[int]]) -> list:
    """The engine's sequences after their prefill and three decode steps."""
    sp = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    while not (len(engine.scheduler.running) == len(prompts) and all(s.prefill_done for s in engine.scheduler.running)):
        engine.step()
    for _ in range(3):
        engine.step()
    return sorted(engine.scheduler.running, key=lambda s: s.seq_id)


@pytest.mark.parametrize("name,cache_dtype", [("tiny-v4", "float"), ("tiny-v41", "packed")])
def test_fixed_step_takes_several_rows_per_request(models, name, cache_dtype):
    """Speculative verification's shape: R rows per request (the next token and R-1 drafted ones) give the
    logits of the dynamic path over the same rows, for R = 3 and then R = 5 on top of what R = 3 wrote."""
    model = models(name)
    prompts = [prompt_of(n, seed=n) for n in (20, 45, 33)]
    fixed, dynamic = make_engine(model, name, cache_dtype=cache_dtype), make_engine(model, name, cache_dtype=cache_dtype)
    a, b = _decoding(fixed, prompts), _decoding(dynamic, prompts)
    assert [s.tokens for s in a] == [s.tokens for s in b]
    step = fixed.runner.decode_step
    for R in (3, 5):
        rows = [[s.tokens[s.num_computed]] + prompt_of(R - 1, seed=7 + i) for i, s in enumerate(a)]
        start = [s.num_computed + (3 if R == 5 else 0) for s in a]
        got = step(step.inputs(rows, start, [s.slot for s in a], [len(s.pages) for s in a]))[0][:len(a)]
        assert got.shape[:2] == (len(a), R)
        with torch.inference_mode():
            want = dynamic.runner.model(torch.tensor(rows), dynamic.runner._state(b), start=torch.tensor(start),
                                        logits_rows=R).logits
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
