"""``--quantization w4a8``: MXFP4 experts multiplied by activations rounded to 8 bits a 32-block (llama.cpp's Q8_0
rounding) through the CPU kernel (csrc/mxfp4_pairs.cpp), set up by the loader (flashserve.model.loader)."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from flashserve.config import load_config
from flashserve.model import cpu_kernels
from flashserve.model.checkpoint import save_checkpoint
from flashserve.model.loader import load_model
from flashserve.model.mapped_experts import MappedExperts
from flashserve.model.packed import MXFP4, PackedExperts

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _decoded(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[E, N, K] float64 weights of MXFP4 bytes (the low nibble the even column) and UE8M0 scales."""
    codes = torch.stack([q & 15, q >> 4], -1).flatten(-2).long()
    return E2M1[codes] * torch.exp2(s.double() - 127).repeat_interleave(32, -1)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """Each 32-block of x's rows as int8 codes round(x / d) times d = max |x| / 127 (float32 arithmetic, ties to
    even), in float64."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv).double() * d.double()).view(x.shape)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_products_are_those_of_the_rounded_rows_on_every_path(isa):
    """Pairs of tokens' rows and experts (an odd number of matrix rows: a last row alone), the gate and up
    projections in one pass: the float64 products of the rounded rows, a block of zeros and a block of a wide
    range included, and about Q8_0's error away from the exact products."""
    g = torch.Generator().manual_seed(1)
    E, N, K = 3, 67, 256
    q, q3 = (torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8) for _ in range(2))
    s, s3 = (torch.randint(110, 130, (E, N, K // 32), generator=g, dtype=torch.uint8) for _ in range(2))
    x = torch.randn(5, K, generator=g)
    x[1, 32:64] = 0
    x[2, 64:96] *= torch.logspace(-6, 3, 32)
    experts = torch.randint(0, E, (5, 2), generator=g)
    rows = [p // 2 for p in range(10)]
    w, w3 = _decoded(q, s), _decoded(q3, s3)
    want = torch.stack([_rounded(x)[r] @ w[e].T for r, e in zip(rows, experts.flatten())])
    want3 = torch.stack([_rounded(x)[r] @ w3[e].T for r, e in zip(rows, experts.flatten())])
    exact = torch.stack([x[r].double() @ w[e].T for r, e in zip(rows, experts.flatten())])

    got = cpu_kernels.mxfp4_pairs_eager(x, experts, q, s, isa, a8=True)
    both = cpu_kernels.mxfp4_pairs_eager(x, experts, q, s, isa, up=(q3, s3), a8=True)
    assert got.shape == (10, N) and both.shape == (2, 10, N)
    assert _rel(got, want) <= 1e-6 and _rel(both[0], want) <= 1e-6 and _rel(both[1], want3) <= 1e-6
    assert 1e-4 <= _rel(got, exact) <= 3e-2
    assert _rel(cpu_kernels.mxfp4_pairs_eager(x, experts, q, s, isa), exact) <= 1e-6  # a8=False stays exact


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """tiny-v41 in the released storage: FP8 blocks, MXFP4 experts."""
    path = tmp_path_factory.mktemp("tiny_v41_released_w4a8")
    save_checkpoint(load_model("tiny-v41", with_mtp=False).checkpoint_tensors(), path, load_config("tiny-v41"))
    return path


def _expert_modules(model) -> list:
    return [m for m in model.modules() if isinstance(m, (PackedExperts, MappedExperts))]


def test_the_released_experts_are_kept_and_multiply_rounded_activations(released):
    """w4a8 on a released checkpoint keeps its MXFP4 bytes as stored and switches every expert module to the
    rounded activations, whose decode-step logits are near the exact ones, not equal; the kernel is asked for it."""
    exact = load_model(released, with_mtp=False)
    a8 = load_model(released, with_mtp=False, quantization="w4a8")
    assert {m.int8_activations for m in _expert_modules(exact)} == {False}
    mods = _expert_modules(a8)
    assert mods and {m.int8_activations for m in mods} == {True}
    assert torch.equal(exact.layers[0].ffn.experts.w1_packed.qweight, a8.layers[0].ffn.experts.w1_packed.qweight)

    asked: list[bool] = []
    real = cpu_kernels.mxfp4_gate_up

    def counting(*args):
        asked.append(args[-1])
        return real(*args)

    x = torch.randn(3, exact.layers[0].ffn.experts.dim, generator=torch.Generator().manual_seed(2))
    idx, w = torch.tensor([[0, 3], [3, 5], [7, 1]]), torch.full((3, 2), 0.5)
    with torch.inference_mode(), mock.patch.object(cpu_kernels, "mxfp4_gate_up", counting):
        one = _rel(a8.layers[0].ffn.experts(x, idx, w), exact.layers[0].ffn.experts(x, idx, w))
        pairs = [(exact(torch.tensor([[t]])).logits, a8(torch.tensor([[t]])).logits) for t in range(1, 21)]
    assert asked and set(asked) == {False, True} and asked.count(True) == asked.count(False)
    assert 1e-4 <= one <= 3e-2  # one MoE layer: the rounding's error, about 1% at 64 inputs a row
    # Ten random layers compound it, and a random router's near ties flip (1% Gaussian noise on the exact experts'
    # outputs does the same: a median of 1.4%, a few tokens far off); a wrong layout would leave nothing in common
    rels = sorted(_rel(got, want) for want, got in pairs)
    assert not any(torch.equal(got, want) for want, got in pairs) and rels[len(rels) // 2] <= 0.1
    assert sum(torch.equal(got.argmax(-1), want.argmax(-1)) for want, got in pairs) >= 16


def test_a_float_model_is_packed_as_mxfp4_and_flagged():
    model = load_model("tiny-v4", with_mtp=False, quantization="w4a8")
    mods = _expert_modules(model)
    assert mods and all(m.w1_packed.fmt.name == MXFP4 and m.int8_activations for m in mods)
