"""Single-row float32 products on the CPU through OpenBLAS (numpy's build) rather than torch's MKL.

At batch 1 a decode step multiplies one row by every weight matrix it reads, so on the CPU its speed is
mostly the speed of those matrix-vector products, and torch's statically linked MKL runs them well below
the memory bandwidth on the AMD CPUs measured here; the OpenBLAS that numpy ships does better. The 215
matrices under 1M values that a batch-1 token of the engine benchmark's peers checkpoint reads (82 MB),
float32, inference mode, median of 9 (AMD EPYC Zen 5, AVX-512, 2 threads): ``torch.mm`` 6.6 ms, OpenBLAS
3.6 ms, 4.1 through :func:`linear`, 5.0 as the compiled step's op. No MKL setting changed its figures
(``MKL_ENABLE_INSTRUCTIONS``, ``MKL_CBWR``, ``MKL_DEBUG_CPU_TYPE``). The compiled batch-1 step gains less,
1.02-1.06x (alternating engines in one process): each call there goes back through Python (~10 us).

:func:`linear` takes this path for single-row float32 CPU products when gradients are off and numpy's BLAS
is OpenBLAS; everything else (several rows, other dtypes, training, CUDA) stays torch's. Inside a compiled
step it is one opaque op (``flashserve::blas_linear``). The two paths sum in different orders, so a prompt's
forward and the decode step's agree to float32 rounding (about 1e-7 relative per product), not bit for bit.

Experts stay torch's: each picked expert as its own OpenBLAS product, read in place, made the compiled step
slower (24 calls a step took 3.0 ms, against the gathered copy and batched product they replaced).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _numpy_uses_openblas() -> bool:
    """Whether numpy's BLAS is OpenBLAS (as numpy's wheels ship it), as threadpoolctl reports it."""
    from threadpoolctl import threadpool_info

    np.ones((2, 2)) @ np.ones((2, 2))  # numpy's BLAS is loaded before asking
    return any(i.get("user_api") == "blas" and i.get("internal_api") == "openblas"
               and "numpy" in str(i.get("filepath", "")) for i in threadpool_info())


OPENBLAS = _numpy_uses_openblas()  # read once at import, not while a step is traced

# More than one row and OpenBLAS runs a general GEMM whose lead is gone or small. One pass over the peers
# checkpoint's matrices (216 at 1 row; all 504 from 2 rows, as a batch's tokens pick most experts), 2 threads,
# ms, torch.mm / OpenBLAS 2 threads / 1 thread: 1 row 11.4 / 5.2 / 5.8; 2 rows 31.2 / 31.5 / 35.3; 4 rows
# 34.9 / 28.0 / 31.0; 16 rows 32.9 / 27.3 / 48.0 (gradients on in that pass, which adds the same to both).
MAX_ROWS = 1


def limit_threads() -> None:
    """Keep OpenBLAS at one thread, process-wide. With torch's second thread spinning between its parallel
    regions, a second OpenBLAS thread fights it for the core: the compiled batch-1 step fell from 116 to 39
    tok/s on 2 cores; a single-row product gains nothing from it anyway (one pass: 5.2 ms against 5.8)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``F.linear(x, w)`` goes through OpenBLAS: up to :data:`MAX_ROWS` float32 CPU rows, gradients
    off."""
    return (OPENBLAS and 0 < x.numel() <= MAX_ROWS * x.shape[-1] and x.device.type == "cpu"
            and x.dtype == torch.float32 and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.dim() == 2 and not torch.is_grad_enabled())


def _mm_np(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T`` [M, N] by numpy's BLAS (any strides)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    np.matmul(x.detach().numpy(), w.detach().numpy().T, out=out.numpy())
    return out


def compiled_cpu(x: torch.Tensor) -> bool:
    """Whether ``x`` is traced into a compiled CPU step, where :func:`reduce_linear` makes one-row products."""
    return torch.compiler.is_compiling() and x.device.type == "cpu"


def compiled_row(x: torch.Tensor) -> bool:
    """:func:`compiled_cpu` and ``x`` is one row."""
    return compiled_cpu(x) and x.numel() == x.shape[-1]


def reduce_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w [..., N, K].T`` [..., N] written as a broadcast product summed over ``K``; an int8
    ``w`` is converted as it is read. Compiled, inductor makes it one vectorised reduction kernel that streams
    ``w`` once (its own GEMV, called from the step's C++ with no dispatch), with an int8 conversion or an
    expert gather fused into the read. Eager it would materialise the product: use it inside compiled steps."""
    if w.dim() == 2 and w.stride(0) == 1 and w.shape[0] > 1:  # column-major (weight_layout): sum over rows
        return (x.unsqueeze(-1) * w.t().to(x.dtype)).sum(-2)
    return (x.unsqueeze(-2) * w.to(x.dtype)).sum(-1)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias): one row in a compiled CPU step :func:`reduce_linear`, eager OpenBLAS where
    :func:`takes` says so, torch otherwise."""
    if compiled_row(x) and x.dtype in (torch.float32, torch.float64) and w.dtype == x.dtype:
        return reduce_linear(x, w)
    if not takes(x, w) or torch.compiler.is_compiling():
        return F.linear(x, w)
    flat = x.reshape(-1, x.shape[-1])
    return _mm_np(flat, w).view(*x.shape[:-1], w.shape[0])


def grouped_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Group ``g`` of ``x [..., G, K]`` times group ``g`` of ``w``'s rows (``w [G * N, K]``, optional per-row
    ``scale``): [..., G, N]. One token in a compiled CPU step: :func:`reduce_linear` (an int8 ``w`` read as is)."""
    G, K = x.shape[-2], x.shape[-1]
    wg = w.view(G, -1, K)
    sg = None if scale is None else scale.view(G, -1)
    if compiled_cpu(x) and x.numel() == G * K:
        y = reduce_linear(x, wg)
    else:
        y = torch.einsum("...gk,gnk->...gn", x, wg.to(x.dtype))
    return y if sg is None else y * sg.to(y.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose single-row float32 CPU products run through :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        return y if self.bias is None else y + self.bias

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., G, in / G]`` by the weight's G row groups (the grouped output projection): [..., G, out / G]."""
        return grouped_linear(x, self.weight)
