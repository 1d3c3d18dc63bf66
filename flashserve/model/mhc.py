"""Manifold-constrained hyper-connections (mHC): 4 residual streams mixed by Sinkhorn matrices (spec §2.3)."""

from __future__ import annotations

import torch
from torch import nn

from . import blas
from .norms import fp32, rms


class HyperMix:
    """Coefficients of one mHC site: ``pre`` [.., n], ``post`` [.., n], ``comb`` [.., n, n] (row = source)."""

    __slots__ = ("pre", "post", "comb")

    def __init__(self, pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        self.pre, self.post, self.comb = pre, post, comb


def hyper_mix(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
              n: int, iters: int, hc_eps: float, norm_eps: float, fn_panels: torch.Tensor | None = None) -> HyperMix:
    """Compute (pre, post, comb) from the streams ``x`` [.., n, D] in fp32 (``fn_panels``: ``fn``'s panel copy,
    see :func:`flashserve.model.blas.linear`)."""
    f = rms(fp32(x.flatten(-2)), norm_eps)
    m = blas.linear(f, fp32(fn), fn_panels)
    base, scale = fp32(base), fp32(scale)
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = (m[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    comb = torch.softmax(logits, dim=-1) + hc_eps
    return HyperMix(pre, post, sinkhorn(comb, iters, hc_eps))


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``iters`` alternating normalisations of ``comb`` [.., n, n]: columns first, then rows and columns
    ``iters - 1`` times, each dividing by (sum + eps).

    At decode this loop is most of mHC's op count, so eager inference works in place with two ops per
    half-step: ``baddbmm`` gives eps + the sums as one batched product with a ones vector, then a divide.
    Training (autograd) takes :func:`_sinkhorn_sums`, compiled steps :func:`_sinkhorn_scalings` (the same values).
    """
    if torch.compiler.is_compiling():
        return _sinkhorn_scalings(comb, iters, eps)
    if torch.is_grad_enabled() and comb.requires_grad:
        return _sinkhorn_sums(comb, iters, eps)
    n = comb.shape[-1]
    c = comb.view(-1, n, n)
    ones_col = c.new_ones(1, n, 1).expand(c.shape[0], n, 1)
    ones_row = c.new_ones(1, 1, n).expand(c.shape[0], 1, n)
    eps_col = c.new_full((1, n, 1), eps).expand(c.shape[0], n, 1)
    eps_row = c.new_full((1, 1, n), eps).expand(c.shape[0], 1, n)
    c.div_(torch.baddbmm(eps_row, ones_row, c))  # eps + column sums [.., 1, n]
    for _ in range(iters - 1):
        c.div_(torch.baddbmm(eps_col, c, ones_col))  # eps + row sums [.., n, 1]
        c.div_(torch.baddbmm(eps_row, ones_row, c))
    return comb


def _sinkhorn_sums(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`sinkhorn` out of place as plain sums, for autograd."""
    c = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def _sinkhorn_scalings(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`sinkhorn` as ``diag(u) · comb · diag(v)`` with each entry of ``u``, ``v`` and ``comb`` its own
    tensor over the leading dims: a half-step only rescales ``u`` or ``v`` (a column sum of
    ``diag(u) K diag(v)`` is ``v_j (Kᵀu)_j``), and as every op is elementwise over the same leading shape inductor
    runs the whole loop in a few loop nests instead of one per sum: compiled on the CPU, 20 iterations were 78
    loops as sums and 4 like this, and the int8 batch-1 step of the engine benchmark's peers checkpoint went from
    2.50 to 2.38 ms (one process, two engines stepping alternately; ``baddbmm`` would be an external kernel
    call per half-step, ~2.5 ms of a 20 ms step when it was tried)."""
    n = comb.shape[-1]
    k = [[comb[..., i, j] for j in range(n)] for i in range(n)]
    u = [1.0] * n
    v = [1 / (sum(k[i][j] for i in range(n)) + eps) for j in range(n)]
    for _ in range(iters - 1):
        kv = [sum(k[i][j] * v[j] for j in range(n)) for i in range(n)]
        u = [u[i] / (u[i] * kv[i] + eps) for i in range(n)]
        v = [v[j] / (v[j] * sum(u[i] * k[i][j] for i in range(n)) + eps) for j in range(n)]
    # u_i · comb_ij · v_j as one product of comb with the stacked scalings: stacking the n² products instead made
    # inductor store each into a view of the result, a tensor handle per entry at every call of the C++ wrapper
    rows = comb if iters == 1 else torch.stack(u, -1).unsqueeze(-1) * comb
    return rows * torch.stack(v, -1).unsqueeze(-2)


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``Σ_j pre_j · x_j``: [.., n, D] → [.., D]."""
    return (pre.unsqueeze(-1) * x).sum(-2).to(x.dtype)


def expand(y: torch.Tensor, x: torch.Tensor, mix: HyperMix) -> torch.Tensor:
    """``post_k · y + Σ_j comb[j, k] · x_j`` (sum over the FIRST index of comb)."""
    xf = fp32(x)
    mixed = blas.einsum("...jk,...jd->...kd", mix.comb.to(xf.dtype), xf)
    return (mix.post.to(xf.dtype).unsqueeze(-1) * fp32(y).unsqueeze(-2) + mixed).to(x.dtype)


class HyperHead(nn.Module):
    """V4's learned final collapse (``hc_head_fn/base/scale``): pre = σ(m·s + b) + eps."""

    ROW_WEIGHTS = ("hc_head_fn",)  # multiplied by blas.linear (panel copies: weight_layout)

    def __init__(self, n: int, dim: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * dim))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = blas.linear(rms(fp32(x.flatten(-2)), self.norm_eps), fp32(self.hc_head_fn),
                        blas.panels(self, "hc_head_fn"))
        pre = torch.sigmoid(m * fp32(self.hc_head_scale) + fp32(self.hc_head_base)) + self.hc_eps
        return collapse(x, pre)
