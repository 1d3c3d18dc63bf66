"""RMS normalisation, weighted (a module named like the checkpoint's ``*.norm``) and unweighted."""

from __future__ import annotations

import torch
from torch import nn


def fp32(x: torch.Tensor) -> torch.Tensor:
    """The accumulation dtype of a tensor: float32, or float64 for float64 tensors (exactness tests)."""
    return x if x.dtype == torch.float64 else x.float()


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last axis, computed in fp32, returned in x's dtype."""
    xf = fp32(x)
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; statistics and scaling in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = fp32(x)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (fp32(self.weight) * y).to(x.dtype)
