"""Fast formulations equal their plain references: Sinkhorn as baddbmm, MoE as grouped matmuls."""

import pytest
import torch

from flashserve.model.mhc import sinkhorn
from flashserve.model.moe import Experts


def plain_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb.clone()
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (0, 2)])
def test_sinkhorn_equals_plain_loop(dtype, shape):
    g = torch.Generator().manual_seed(0)
    comb = torch.softmax(3 * torch.randn(*shape, 4, 4, generator=g, dtype=dtype), -1) + 1e-6
    want = plain_sinkhorn(comb, 20, 1e-6)
    got = sinkhorn(comb.clone(), 20, 1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
    if comb.numel():
        torch.testing.assert_close(got.sum(-2), torch.ones_like(got.sum(-2)), rtol=0, atol=1e-4)


def _experts(dtype):
    torch.manual_seed(0)
    ex = Experts(16, 64, 32, limit=7.0)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.2)
    return ex.to(dtype)


@pytest.mark.parametrize("tokens", [1, 3, 64, 257])
def test_grouped_mm_equals_expert_loop(tokens):
    ex = _experts(torch.float32)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    idx = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)])
    if tokens == 3:
        idx = torch.tensor([[1, 2, 3, 4]] * 3)  # twelve experts with no token
    w = torch.rand(tokens, 4, generator=g)
    assert ex._grouped_mm_ok(x)
    with torch.no_grad():
        want = ex._grouped(x, idx, w)
        torch.testing.assert_close(ex._grouped_mm(x, idx, w), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ex._gathered(x, idx, w), want, rtol=1e-5, atol=1e-5)


def test_grouped_mm_not_used_where_unsupported():
    ex = _experts(torch.float64)
    assert not ex._grouped_mm_ok(torch.zeros(2, 64, dtype=torch.float64))
    odd = Experts(4, 6, 5, limit=7.0)  # rows of 24 and 20 bytes: not 16-byte aligned
    assert not odd._grouped_mm_ok(torch.zeros(2, 6))
