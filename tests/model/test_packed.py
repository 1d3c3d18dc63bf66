"""Weights packed in memory: the packed forward equals the float forward over the same (dequantized)
weights, a released checkpoint stays in its stored bytes (resident within 1.1x of its files), float
checkpoints quantize at load exactly as in memory, and bad choices are refused before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flashserve.config import ConfigError
from flashserve.model import load_model
from flashserve.model import quant
from flashserve.model.checkpoint import save_checkpoint
from flashserve.model.packed import (FLOAT, PackedEmbedding, PackedExperts, PackedLinear,
                                     dequantized_state, resident_bytes)
from step_modes import compile_as_step

torch.set_grad_enabled(False)
IDS = torch.randint(3, 500, (2, 37), generator=torch.Generator().manual_seed(3))


def _float_twin(packed, preset: str, dtype=torch.float32):
    """The float model computing with exactly the weights the packed model decodes."""
    twin = load_model(preset, dtype=dtype)
    dest = twin.checkpoint_tensors()
    for name, w in dequantized_state(packed).items():
        dest[name].copy_(w)
    return twin


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("preset,method", [("tiny-v41", "fp8"), ("tiny-v41", "mxfp4"), ("tiny-v4", "mxfp4")])
def test_packed_forward_equals_float_forward_of_its_weights(preset, method):
    packed = load_model(preset, quantization=method)
    kinds = {type(m) for m in packed.modules()}
    assert {PackedLinear, PackedExperts, PackedEmbedding} & kinds >= {PackedLinear, PackedExperts}
    assert not any(p.dim() == 3 for p in packed.parameters())  # the routed experts are packed
    got, want = packed(IDS).logits, _float_twin(packed, preset)(IDS).logits
    # fp8 and mxfp4 decode to values float32 holds exactly, and run the float model's own kernels
    assert _rel(got, want) <= 1e-6
    assert resident_bytes(packed) < 0.45 * resident_bytes(load_model(preset))


def test_int8_modules_equal_float_modules_of_their_weights():
    """int8 runs its own kernel (``_weight_int8pack_mm`` or chunked conversion), whose summation order differs: each packed module
    against the float module over the same decoded weights, within 1e-5 relative (a whole random model would
    amplify that through near-tied routing)."""
    packed = load_model("tiny-v41", quantization="int8")
    twin = _float_twin(packed, "tiny-v41")
    g = torch.Generator().manual_seed(0)
    checked = 0
    for name, module in packed.named_modules():
        ref = twin.get_submodule(name) if isinstance(module, (PackedLinear, PackedExperts)) else None
        if isinstance(module, PackedLinear):
            x = torch.randn(5, module.in_features, generator=g)
            assert _rel(module(x), ref(x)) <= 1e-5, name
        elif isinstance(module, PackedExperts):
            for tokens in (1, 40):  # the gathered path (decode) and the per-expert loop (prefill)
                x = torch.randn(tokens, module.dim, generator=g)
                idx = torch.randint(0, module.n_experts, (tokens, 2), generator=g)
                w = torch.rand(tokens, 2, generator=g)
                assert _rel(module(x, idx, w), ref(x, idx, w)) <= 1e-5, (name, tokens)
        else:
            continue
        checked += 1
    assert checked > 20
    assert resident_bytes(packed) < 0.45 * resident_bytes(load_model("tiny-v41"))


@pytest.mark.parametrize("fmt,rows,path", [
    ("fp8", 1, "_gathered"), ("fp8", 6, "_dense"), ("fp8", 33, "_grouped"),
    ("mxfp4", 1, "_gathered"), ("mxfp4", 6, "_gathered"), ("mxfp4", 33, "_grouped"),
    ("mxfp4 without kernel", 6, "_dense")])
def test_each_packed_expert_path_equals_float_experts_of_its_weights(fmt, rows, path, monkeypatch):
    """Packed experts pick their path by rows (one pair per expert at most: gathered; a few rows: every
    expert on every row, or, MXFP4 with the CPU kernel, each pair through the kernel; prefill-sized: the
    per-expert loop); each equals float experts over the decoded weights."""
    from flashserve.model import cpu_kernels
    from flashserve.model.moe import Experts
    from flashserve.model.packed import EXPERT_FP4, Format

    if fmt == "mxfp4 without kernel":
        monkeypatch.setattr(cpu_kernels, "mxfp4_pairs_available", lambda: False)
    E, D, I = 8, 64, 32
    g = torch.Generator().manual_seed(rows)
    packed = PackedExperts(E, D, I, 7.0, EXPERT_FP4 if fmt.startswith("mxfp4") else Format("fp8", 32, 32))
    ref = Experts(E, D, I, 7.0)
    for name in ("w1", "w2", "w3"):
        getattr(packed, f"{name}_packed").set_float(torch.randn(getattr(ref, name).shape, generator=g))
        getattr(ref, name).copy_(packed.expert_weights(name, torch.float32))
    taken = []
    for p in ("_gathered", "_dense", "_grouped"):
        monkeypatch.setattr(PackedExperts, p, lambda self, *a, _p=p, _f=getattr(PackedExperts, p): (taken.append(_p), _f(self, *a))[1])
    x = torch.randn(rows, D, generator=g)
    idx = torch.rand(rows, E, generator=g).topk(2, dim=-1).indices
    w = torch.rand(rows, 2, generator=g)
    got = packed(x, idx, w)
    assert taken == [path]
    assert _rel(got, ref._grouped(x, idx, w)) <= 1e-6  # same decoded weights; only the summation order differs


@pytest.mark.parametrize("pays,kernel", [(False, False), (True, True)])
def test_int8_rows_decode_in_chunks_unless_torchs_int8_kernel_pays(pays, kernel, monkeypatch):
    """Where torch's int8 kernel is slower (no AVX-512, or measured so) int8 rows are converted a
    chunk at a time (here 3 rows of 64 columns: 7 chunks and a partial one), each chunk's products scaled by
    its rows' scales; where it pays, ``_weight_int8pack_mm`` runs."""
    from flashserve.model import packed as packed_mod
    from flashserve.model.packed import ROW_INT8

    monkeypatch.setattr(packed_mod, "_INT8PACK", (pays, pays))
    monkeypatch.setattr(packed_mod, "INT8_CHUNK_VALUES", 3 * 64)
    calls = []
    real = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(packed_mod.torch.ops.aten, "_weight_int8pack_mm",
                        lambda *a: (calls.append(1), real(*a))[1], raising=False)
    lin = PackedLinear(64, 22, ROW_INT8)
    g = torch.Generator().manual_seed(1)
    lin.packed.set_float(torch.randn(22, 64, generator=g))
    x = torch.randn(2, 5, 64, generator=g)
    want = x @ lin.packed.dequantize(torch.float32).t()
    got = lin(x)
    assert got.shape == (2, 5, 22) and bool(calls) == kernel
    assert _rel(got, want) <= 1e-6


@pytest.mark.parametrize("fmt,shape", [("mxfp4", (3, 64, 96)), ("fp8", (300, 200)), ("int8", (3, 64, 96))])
def test_a_compiled_graph_decodes_through_the_eager_tables(fmt, shape):
    """Inside a compiled graph on the CPU, decoding is one opaque op running the eager table lookups (inductor's
    own decode arithmetic was slower than eager): the same values as eager decoding, gathered experts too."""
    from flashserve.model.packed import EXPERT_FP4, ROW_INT8, Format, decode, encode

    f = {"mxfp4": EXPERT_FP4, "fp8": Format("fp8", 128, 128), "int8": ROW_INT8}[fmt]
    q, sc = encode(torch.randn(*shape, generator=torch.Generator().manual_seed(2)), f)
    graphs = []

    def recording(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    if len(shape) == 3:  # experts: the rows a step gathers
        pick = torch.tensor([2, 0])
        fn = compile_as_step(lambda q, s, i: decode(q[i], s[i], f, shape[-1], torch.float32), backend=recording,
                           fullgraph=True)
        got, want = fn(q, sc, pick), decode(q, sc, f, shape[-1], torch.float32)[pick]
    else:
        fn = compile_as_step(lambda q, s: decode(q, s, f, shape[-1], torch.float32), backend=recording, fullgraph=True)
        got, want = fn(q, sc), decode(q, sc, f, shape[-1], torch.float32)
    assert torch.equal(got, want)
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert "flashserve.decode_packed" in ops


@pytest.mark.parametrize("fmt", ["mxfp4", "int8"])
def test_every_expert_on_every_row_runs_in_chunks_compiled_equal_to_eager(fmt, monkeypatch):
    """The all-experts path decodes DENSE_CHUNK_BYTES of experts at a time (here 3 of 8: chunks of 3, 3 and 2),
    equal to float experts of the decoded weights; compiled, its chunks decode in inductor's own kernels (no
    opaque decode op) and give eager's numbers."""
    from torch._inductor.compile_fx import compile_fx

    from flashserve.model import moe
    from flashserve.model.moe import Experts
    from flashserve.model.packed import EXPERT_FP4, ROW_INT8

    E, D, I = 8, 64, 32
    monkeypatch.setattr(moe, "DENSE_CHUNK_BYTES", 3 * 3 * I * D * 4)
    g = torch.Generator().manual_seed(7)
    packed = PackedExperts(E, D, I, 7.0, EXPERT_FP4 if fmt == "mxfp4" else ROW_INT8)
    ref = Experts(E, D, I, 7.0)
    for name in ("w1", "w2", "w3"):
        getattr(packed, f"{name}_packed").set_float(torch.randn(getattr(ref, name).shape, generator=g))
        getattr(ref, name).data.copy_(packed.expert_weights(name, torch.float32))
    x = torch.randn(6, D, generator=g)
    idx = torch.rand(6, E, generator=g).topk(2, dim=-1).indices
    w = torch.rand(6, 2, generator=g)
    asked = []
    real = PackedExperts.expert_weights
    monkeypatch.setattr(PackedExperts, "expert_weights",
                        lambda self, n, dt, i=None: (asked.append(i), real(self, n, dt, i))[1])
    eager = packed._dense(x, idx, w)
    monkeypatch.setattr(PackedExperts, "expert_weights", real)
    assert [(i.start, i.stop) for i in asked[::3]] == [(0, 3), (3, 6), (6, 8)]
    assert _rel(eager, ref._grouped(x, idx, w)) <= 1e-6
    graphs = []

    def inductor(gm, inputs):
        graphs.append(gm)
        return compile_fx(gm, inputs)

    compiled = compile_as_step(packed._dense, backend=inductor, fullgraph=True)(x, idx, w)
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert ops and "flashserve.decode_packed" not in ops
    assert _rel(compiled, eager) <= 1e-6


def test_compiled_whole_mxfp4_decode_is_inductors_lookup_and_exact():
    """Decoding every expert (the step that runs all experts at several rows) is traced, not the opaque op:
    inductor's kernel gives eager's values bit for bit, for every byte value and for a zero (2^-127) scale."""
    from flashserve.model.packed import EXPERT_FP4, PackedWeights

    pw = PackedWeights((2, 16, 512), EXPERT_FP4)
    pw.set_float(torch.randn(2, 16, 512, generator=torch.Generator().manual_seed(6)))
    pw.qweight.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every pair of E2M1 codes
    pw.scale[0, 0, 0], pw.scale[1, 3, 5] = 0, 254
    want = pw.dequantize(torch.float32)
    graphs = []

    def recording(gm, inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, inputs)

    got = compile_as_step(lambda: pw.dequantize(torch.float32), backend=recording, fullgraph=True)()
    assert torch.equal(got, want)
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert ops and "flashserve.decode_packed" not in ops


def test_a_compiled_int8_layer_equals_eager():
    """int8 dense products (rows converted a chunk at a time) traced whole: the eager layer's numbers."""
    from flashserve.model.packed import ROW_INT8

    lin = PackedLinear(64, 9000, ROW_INT8)  # two chunks of INT8_CHUNK_VALUES (8192 rows of 64)
    lin.packed.set_float(torch.randn(9000, 64, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    graphs = []

    def recording(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    want = lin(x)  # first eagerly, as an engine plans before it traces: the one-time timing is not traced
    assert torch.equal(compile_as_step(lin, backend=recording, fullgraph=True)(x), want)
    assert graphs


def test_int8_linear_stays_close_to_its_float_weights():
    """Per-row int8 rounds each weight by at most half a step: outputs stay within 1% of the float layer's."""
    float_model = load_model("tiny-v41")
    packed = load_model("tiny-v41", quantization="int8")
    x = torch.randn(5, float_model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for name in ("head", "layers.0.attn.wq_a"):
        want = float_model.get_submodule(name)(x)
        got = packed.get_submodule(name)(x)
        assert 0 < _rel(got, want) < 0.01, name


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_released_checkpoint_stays_packed(preset, tmp_path, monkeypatch):
    save_checkpoint(load_model(preset).checkpoint_tensors(), tmp_path, load_model(preset).cfg)
    file_bytes = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))

    def no_float_copy(*_a, **_k):
        raise AssertionError("a packed weight was decoded to float while loading")

    with monkeypatch.context() as m:  # the stored bytes go straight into the packed buffers
        m.setattr(quant, "dequantize_fp8_grid", no_float_copy)
        m.setattr(quant, "dequantize_mxfp4", no_float_copy)
        packed = load_model(tmp_path, dtype="bfloat16")
    assert resident_bytes(packed) <= 1.1 * file_bytes
    from safetensors import safe_open

    with safe_open(next(tmp_path.glob("*.safetensors")), "pt") as f:
        for key, buffer in (("layers.0.attn.wq_a.weight", packed.layers[0].attn.wq_a.packed.qweight),
                            ("layers.0.ffn.experts.1.w2.weight", packed.layers[0].ffn.experts.w2_packed.qweight[1]),
                            ("layers.0.ffn.experts.1.w2.scale", packed.layers[0].ffn.experts.w2_packed.scale[1])):
            assert torch.equal(f.get_tensor(key).view(torch.uint8), buffer), key
    unpacked = load_model(tmp_path, dtype="bfloat16", quantization=FLOAT)
    assert not any(isinstance(m, (PackedLinear, PackedExperts, PackedEmbedding)) for m in unpacked.modules())
    assert torch.equal(packed(IDS).logits, unpacked(IDS).logits)


def test_mixed_checkpoint_keeps_each_tensor_as_stored(tmp_path):
    """Float dense layers with MXFP4 experts (what the llama.cpp comparison writes): experts packed, the rest
    float, and the same logits as unpacking everything."""
    from flashserve.bench.llamacpp import write_peer_checkpoint

    write_peer_checkpoint(load_model("tiny-v4"), tmp_path)
    model = load_model(tmp_path)
    assert isinstance(model.layers[0].ffn.experts, PackedExperts)
    assert isinstance(model.layers[0].attn.wq_a, torch.nn.Linear)
    assert torch.equal(model(IDS).logits, load_model(tmp_path, quantization=FLOAT)(IDS).logits)


@pytest.mark.parametrize("method", ["int8", "w8a8", "mxfp4"])
def test_float_checkpoint_quantizes_at_load_as_in_memory(method, tmp_path):
    """Quantizing through the loader (one tensor at a time) gives the bytes that packing the float model gives."""
    model = load_model("tiny-v41")
    save_checkpoint(model.checkpoint_tensors(), tmp_path, model.cfg, quantize=False)
    loaded = load_model(tmp_path, quantization=method)
    in_memory = load_model("tiny-v41", quantization=method)
    a, b = dict(loaded.named_buffers()), dict(in_memory.named_buffers())
    packed_names = [n for n in b if n.endswith(("packed.qweight", "packed.scale"))]
    assert packed_names and all(torch.equal(a[n], b[n]) for n in packed_names)
    assert torch.equal(loaded(IDS).logits, in_memory(IDS).logits)


def test_unknown_quantization_is_refused_before_loading():
    with pytest.raises(ConfigError, match="unknown quantization 'int4'.*int8, w8a8, fp8, mxfp4, w4a8, float"):
        load_model("tiny-v41", quantization="int4")
    run = subprocess.run([sys.executable, "-m", "flashserve", "generate", "tiny-v41", "hi", "--quantization", "q4"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--quantization: invalid choice: 'q4'" in run.stderr


def test_e2m1_from_bits_is_the_table_bit_for_bit():
    codes = torch.arange(256, dtype=torch.uint8)
    for nibble in (codes & 15, codes >> 4):
        assert torch.equal(quant.e2m1_from_bits(nibble).view(torch.int32), quant.e2m1_decode(nibble).view(torch.int32))


def test_mxfp4_pair_products_equal_decoded_weights_times_rows():
    """Each pair's row times its own MXFP4 matrix, the bytes decoded as read, eager and compiled: the product of
    the decoded weights (every byte value, scales from 2^-20 to 2^20)."""
    from flashserve.model.packed import EXPERT_FP4, PackedWeights, mxfp4_pairs_linear

    g = torch.Generator().manual_seed(11)
    pw = PackedWeights((5, 24, 96), EXPERT_FP4)
    pw.set_float(torch.randn(5, 24, 96, generator=g))
    pw.qweight.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    pw.scale.copy_(torch.randint(107, 148, pw.scale.shape, generator=g, dtype=torch.uint8))
    experts = torch.tensor([4, 0, 0, 2, 3, 1, 4])
    x = torch.randn(len(experts), 96, generator=g)
    want = torch.bmm(pw.dequantize(torch.float64)[experts], x.double()[:, :, None])[..., 0]
    got = mxfp4_pairs_linear(x, pw.qweight[experts], pw.scale[experts])
    assert got.dtype == torch.float32 and got.shape == (7, 24)
    assert _rel(got.double(), want) <= 1e-6
    compiled = compile_as_step(mxfp4_pairs_linear, fullgraph=True)(x, pw.qweight[experts], pw.scale[experts])
    assert _rel(compiled.double(), want) <= 1e-6


@pytest.mark.parametrize("fmt", ["float", "int8", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 6, 16])
def test_compiled_experts_multiply_each_pair_as_stored(fmt, rows):
    """A compiled CPU step runs only the routed (row, expert) pairs, each reading its expert as stored: no
    batched product over every expert (what several rows ran before), no opaque decode; the eager values."""
    from torch._inductor.compile_fx import compile_fx

    from flashserve.model.moe import Experts
    from flashserve.model.packed import EXPERT_FP4, ROW_INT8

    E, D, I = 8, 64, 32
    g = torch.Generator().manual_seed(rows)
    ex = Experts(E, D, I, 7.0) if fmt == "float" else PackedExperts(E, D, I, 7.0, EXPERT_FP4 if fmt == "mxfp4" else ROW_INT8)
    for name in ("w1", "w2", "w3"):
        w = torch.randn((E, D, I) if name == "w2" else (E, I, D), generator=g)
        getattr(ex, name).copy_(w) if fmt == "float" else getattr(ex, f"{name}_packed").set_float(w)
    x = torch.randn(rows, D, generator=g)
    idx = torch.rand(rows, E, generator=g).topk(3, dim=-1).indices
    w = torch.rand(rows, 3, generator=g)
    graphs = []

    def inductor(gm, inputs):
        graphs.append(gm)
        return compile_fx(gm, inputs)

    torch._dynamo.reset()
    got = compile_as_step(ex, backend=inductor, fullgraph=True)(x, idx, w)
    assert _rel(got, ex._grouped(x, idx, w)) <= 1e-5
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert ops and not any("bmm" in op or "decode_packed" in op or "scatter" in op for op in ops), ops


def test_int8_weights_of_one_input_share_one_kernel_call_with_their_own_sums(monkeypatch):
    """The int8 layers of a group (widths 40, 8 and 33; a float layer and a missing path beside them) get their
    rows stored one after another, each layer's bytes a view of them with its own values and names. One row of a
    compiled CPU graph, where the int8 kernel is preferred, multiplies all three in one kernel call, each output
    the sum the layer's own call gives, bit for bit; the float layer is left to the caller. A second join keeps
    the first. Several rows, eager code, CPUs that prefer inductor's product, a group of one int8 layer, layers of
    another input width and w8a8 layers get no joint product."""
    from torch._inductor.utils import run_and_get_code

    from flashserve.model import blas, cpu_kernels
    from flashserve.model.packed import ROW_INT8, ROW_W8A8, join_int8_rows

    monkeypatch.setattr(cpu_kernels, "int8_pairs_preferred", lambda: True)
    g = torch.Generator().manual_seed(6)
    mod = torch.nn.ModuleDict({n: PackedLinear(64, w, ROW_INT8) for n, w in (("a", 40), ("b", 8), ("c", 33))})
    mod["f"] = blas.Linear(64, 5, bias=False)
    for n in "abc":
        mod[n].packed.set_float(torch.randn(mod[n].out_features, 64, generator=g))
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    paths = ("a.weight", "f.weight", "b.weight", "missing.weight", "c.weight")
    assert join_int8_rows(mod, "x", paths)
    assert mod.x_joint_int8_of == (("a.weight", "b.weight", "c.weight"), (40, 8, 33))
    assert mod.x_joint_int8_q.shape == (81, 64) and mod.x_joint_int8_s.shape == (81,)
    state = mod.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)
    q = mod.x_joint_int8_q
    for n, row in zip("abc", (0, 40, 48)):  # views of the joined rows: no bytes added
        assert mod[n].packed.qweight.data_ptr() == q[row].data_ptr()
        assert mod[n].packed.scale.data_ptr() == mod.x_joint_int8_s[row].data_ptr()
    joint = mod.x_joint_int8_q
    assert join_int8_rows(mod, "x", paths) and mod.x_joint_int8_q is joint  # joined once (two engines, one model)
    assert not join_int8_rows(mod, "one", ("a.weight", "f.weight"))
    other = torch.nn.ModuleDict({"a": PackedLinear(64, 8, ROW_INT8), "k": PackedLinear(32, 8, ROW_INT8),
                                 "w": PackedLinear(64, 8, ROW_W8A8)})
    assert not join_int8_rows(other, "x", ("a.weight", "k.weight"))  # another input width
    assert not join_int8_rows(other, "x", ("a.weight", "w.weight"))  # w8a8 quantizes its input: its own call
    assert not hasattr(other, "x_joint_int8_of")
    x = torch.randn(1, 64, generator=g)
    assert blas.joint_products(x, mod, "x") == {}  # eager
    with torch.inference_mode():
        torch._dynamo.reset()
        f = compile_as_step(lambda x: blas.joint_products(torch.tanh(x), mod, "x"), dynamic=False,
                          options={"cpp_wrapper": True})
        got, (code,) = run_and_get_code(f, x)
        torch._dynamo.reset()
        own = compile_as_step(lambda x: [mod[n](torch.tanh(x)) for n in "abc"], dynamic=False)(x)
        torch._dynamo.reset()
        rows = compile_as_step(lambda x: blas.joint_products(x, mod, "x"), dynamic=False)(x.expand(3, 64))
    assert code.count("flashserve::int8_pairs") == 1 and rows == {}
    assert list(got) == ["a.weight", "b.weight", "c.weight"]
    for path, want in zip(got, own):
        assert got[path].shape == want.shape and torch.equal(got[path], want)
    monkeypatch.setattr(cpu_kernels, "int8_pairs_preferred", lambda: False)
    with torch.inference_mode():
        torch._dynamo.reset()
        assert compile_as_step(lambda x: blas.joint_products(x, mod, "x"), dynamic=False)(x) == {}
