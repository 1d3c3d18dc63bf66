"""Manifold-constrained hyper-connections (mHC): 4 residual streams mixed by Sinkhorn matrices
(docs/architecture.md#mhc)."""

from __future__ import annotations

import torch
from torch import nn

from . import blas, cpu_kernels, modes
from .modes import COMPILED, COMPILED_CPU
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


@modes.per_mode
def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``iters`` alternating normalisations of ``comb`` [.., n, n]: columns first, then rows and columns
    ``iters - 1`` times, each dividing by (sum + eps).

    At decode this loop is most of mHC's op count, so eager inference works in place with two ops per
    half-step: ``baddbmm`` gives eps + the sums as one batched product with a ones vector, then a divide.
    Training (autograd) takes :func:`_sinkhorn_sums`, compiled steps :func:`_sinkhorn_scalings` (the same values),
    on the CPU through its C++ kernel (:func:`~flashserve.model.cpu_kernels.sinkhorn`: the same values, bit for bit
    at n = 4).
    """
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


@sinkhorn.variant(COMPILED)
def _sinkhorn_compiled(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return _sinkhorn_scalings(comb, iters, eps)


@sinkhorn.variant(COMPILED_CPU)
def _sinkhorn_compiled_on_cpu(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    if comb.dtype == torch.float32 and cpu_kernels.sinkhorn_available():
        return cpu_kernels.sinkhorn(comb, iters, eps)
    return _sinkhorn_scalings(comb, iters, eps)


def _sinkhorn_sums(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`sinkhorn` out of place as plain sums, for autograd."""
    c = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def _sinkhorn_scalings(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`sinkhorn` as ``diag(u) · comb · diag(v)``: a half-step only rescales ``u`` [.., n] or ``v`` [.., n]
    (a column sum of ``diag(u) K diag(v)`` is ``v_j (Kᵀu)_j``), so ``comb`` is read, never rewritten, and inductor
    keeps the whole loop in the kernels around it (no ``baddbmm``: an external kernel call per half-step, ~2.5 ms
    of a 20 ms CPU step when it was tried).

    A half-step is a handful of ops on [.., n] and [.., n, n] tensors. Written entry by entry (n² tensors, ~88 ops
    an iteration) the graph grew by ~1,500 nodes per mHC site at 20 iterations, and tracing them was most of a
    compile: dynamo and AOT on a 5-layer tiny-v41 step with dynamic batch took 191.5 s, against 71.1 s like this
    (2 CPU cores; 74.0 and 53.6 s at 3 iterations). The values are the same, bit for bit, and the compiled
    Sinkhorn alone ran 61 against 94 us a call (20 iterations, 16 rows, 2 threads)."""
    v = 1 / (comb.sum(-2) + eps)  # the first half-step: columns
    u = torch.ones_like(v)
    for _ in range(iters - 1):
        u = u / (u * (comb * v.unsqueeze(-2)).sum(-1) + eps)  # rows of diag(u) K diag(v)
        v = v / (v * (u.unsqueeze(-1) * comb).sum(-2) + eps)  # its columns
    return u.unsqueeze(-1) * comb * v.unsqueeze(-2)


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
