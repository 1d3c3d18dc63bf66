"""``--quantization w8a8``: int8 weight rows times activations quantized per token. fbgemm's kernel gives the
numbers of the plain-float reference, a token's numbers do not depend on its batch, a layer repacks its
kernel when its weights change, and a compiled graph calls the kernel as one op."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flashserve.config import ConfigError
from flashserve.model import load_model, w8a8
from flashserve.model.packed import (INT8, W8A8, Format, PackedExperts, PackedLinear, prepare_kernels,
                                     resident_bytes)
from step_modes import compile_as_step

torch.set_grad_enabled(False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _layer(rows: int = 300, cols: int = 96, seed: int = 0) -> PackedLinear:
    lin = PackedLinear(cols, rows, Format(W8A8))
    lin.packed.set_float(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)))
    return lin


def _tokens(cols: int = 96) -> torch.Tensor:
    """Seven tokens of very different sizes, one of them all zeros."""
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(1))
    return x * torch.tensor([1e-3, 1.0, 10.0, 300.0, 0.5, 2.0, 0.0])[:, None]


def test_kernel_equals_reference_and_each_token_is_its_own():
    lin = _layer()
    x = _tokens()
    got = lin(x)
    assert lin.kernel is not None  # fbgemm ran (x86)
    want = w8a8.reference(x, lin.packed.qweight, lin.packed.scale)
    assert _rel(got, want) <= 1e-6
    assert not got[6].any()
    for i in range(len(x)):  # alone or in a batch: the same bits
        assert torch.equal(lin(x[i:i + 1]), got[i:i + 1]), i


def test_each_token_is_quantized_to_129_levels_of_its_absmax():
    """Through an identity matrix the kernel returns the quantized tokens: multiples of absmax/64, at most
    half a step from the token, its absmax exact."""
    lin = PackedLinear(96, 96, Format(W8A8))
    lin.packed.set_float(torch.eye(96))
    x = _tokens()[:6]
    got = lin(x)
    amax = x.abs().amax(-1, keepdim=True)
    steps = got / amax * 64
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    assert (got - x).abs().le(amax / 128 * (1 + 1e-5)).all()
    assert torch.allclose(got.abs().amax(-1, keepdim=True), amax, rtol=1e-6)


def test_products_stay_close_to_the_float_layer():
    """Per-row int8 weights and 129 activation levels: a Gaussian layer within 3% of its float product
    (about 1.6% measured), where weight-only int8 is within 1%."""
    w = torch.randn(512, 512, generator=torch.Generator().manual_seed(2))
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(3))
    lin = PackedLinear(512, 512, Format(W8A8))
    lin.packed.set_float(w)
    err = ((lin(x) - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert 0.005 < err < 0.03


def test_kernel_is_repacked_when_the_weights_change():
    lin = _layer(seed=0)
    x = _tokens()
    before = lin(x)
    lin.packed.set_float(torch.randn(300, 96, generator=torch.Generator().manual_seed(5)))
    after = lin(x)
    assert _rel(after, w8a8.reference(x, lin.packed.qweight, lin.packed.scale)) <= 1e-6
    assert _rel(after, before) > 0.1


@pytest.mark.parametrize("backend", ["recording", "inductor"])
def test_a_compiled_graph_calls_the_kernel_as_one_op(backend):
    lin = _layer(rows=64, cols=32)
    x = _tokens(32)
    want = lin(x)  # eager: packs the kernel, as the engine does at start-up
    graphs = []

    def recording(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    fn = compile_as_step(lin, backend=recording if backend == "recording" else "inductor", fullgraph=True)
    got = fn(x)
    if graphs:
        ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
        assert "flashserve.w8a8_mm" in ops
        assert torch.equal(got, want)
    else:
        assert _rel(got, want) <= 1e-6


def test_w8a8_model_packs_dense_layers_and_keeps_experts_weight_only():
    model = load_model("tiny-v41", quantization="w8a8")
    assert model.head.packed.fmt.name == W8A8
    assert model.layers[0].attn.wq_a.packed.fmt.name == W8A8
    experts = model.layers[0].ffn.experts
    assert isinstance(experts, PackedExperts) and experts.w1_packed.fmt.name == INT8
    dense = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert resident_bytes(model) < 0.45 * resident_bytes(load_model("tiny-v41"))  # before fbgemm's copies
    assert prepare_kernels(model) == len(dense) > 10
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(4))
    logits = model(ids).logits
    assert torch.isfinite(logits).all()


def test_w8a8_is_refused_with_tensor_parallelism_before_loading():
    from flashserve.engine import preflight
    from flashserve.engine.engine_config import EngineConfig

    with pytest.raises(ConfigError, match="w8a8 quantizes each token's whole activation row"):
        preflight.check(EngineConfig(model="tiny-v41", quantization="w8a8", tensor_parallel_size=2))


def test_memory_counts_the_kernel_copies():
    """fbgemm keeps its own copy of each matrix: the process grows by what ``kernel_bytes`` says, and
    ``resident_bytes`` and ``flashserve info --memory`` count it."""
    from flashserve.config.ranks import Layout
    from flashserve.parallel.memory import rank_memory

    # 64 MiB: over glibc's largest mmap threshold (32 MiB), so the copy is fresh pages, not reused heap. Measured in
    # a fresh process: in a test worker that ran other tests first, the copy landed in pages already resident
    # (the process grew by 0 bytes, seen on an Ice Lake machine)
    child = """
import json, torch
from flashserve.model.packed import W8A8, Format, PackedLinear
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
big = PackedLinear(4096, 16384, Format(W8A8))
big.packed.set_float(torch.randn(16384, 4096, generator=torch.Generator().manual_seed(6)))
before = rss()
big.prepare_kernel()
print(json.dumps([rss() - before, big.kernel_bytes()]))
"""
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    grown, kernel_bytes = json.loads(run.stdout.strip().splitlines()[-1])
    assert 0.9 * kernel_bytes <= grown <= 1.2 * kernel_bytes

    model = load_model("tiny-v41", quantization="w8a8", with_mtp=False)
    bare = resident_bytes(model)
    prepare_kernels(model)
    copies = sum(m.kernel_bytes() for m in model.modules() if isinstance(m, PackedLinear))
    assert copies > sum(m.packed.qweight.numel() for m in model.modules() if isinstance(m, PackedLinear))
    assert resident_bytes(model) == bare + copies
    planned = rank_memory("tiny-v41", Layout(1, False, 1), dtype="float32", quantization="w8a8")
    int8 = rank_memory("tiny-v41", Layout(1, False, 1), dtype="float32", quantization="int8")
    assert planned.resident_weight_bytes == int8.resident_weight_bytes + copies
