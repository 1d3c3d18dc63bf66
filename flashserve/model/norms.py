"""RMS normalisation, weighted (a module named like the checkpoint's ``*.norm``) and unweighted."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fp32(x: torch.Tensor) -> torch.Tensor:
    """The accumulation dtype of a tensor: float32, or float64 for float64 tensors (exactness tests)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last axis, computed in fp32, returned in x's dtype."""
    y = F.rms_norm(fp32(x), (x.shape[-1],), eps=eps)
    return y if y.dtype == x.dtype else y.to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; statistics and scaling in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = fp32(x)
        y = F.rms_norm(xf, (x.shape[-1],), fp32(self.weight), eps=self.eps)
        return y if y.dtype == x.dtype else y.to(x.dtype)
