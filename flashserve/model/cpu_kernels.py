"""C++ kernels for the CPU where inductor's generated code falls short, compiled at first use with inductor's
own compiler settings for this CPU (its on-disk cache keeps them between runs: about 2 s the first time).

One kernel so far, :func:`mxfp4_pairs`: the (row, expert) pair products of MXFP4 experts, each expert's bytes
decoded once for all its rows (``csrc/mxfp4_pairs.cpp``). One MXFP4 expert projection of the peers checkpoint
(16 x 256x512), 2 threads, median ms: 64 pairs (16 rows, top-4) 0.12 against 1.07 for inductor's code of
:func:`flashserve.model.packed.mxfp4_pairs_linear`, 4 pairs (one row) 0.017 against 0.086 (docs/engine-speed.md,
ninth session); with the weights evicted as in a step (the tenth session's tiles, hints and row pairs) 0.16 where
the first version took 0.23. Where no C++ compiler works the kernel is not available and the traced code runs
(:func:`mxfp4_pairs_available` says which).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "mxfp4_pairs.cpp"
_ARGS = ("const float*", "const int64_t*", "const uint8_t*", "const uint8_t*", "float*",
         "int64_t", "int64_t", "int64_t", "int64_t", "int64_t")  # x, experts, q, s, out, P, E, N, K, threads
ISAS = ("native", "avx2", "scalar")  # the paths of the source: what the CPU has, AVX2 only, no intrinsics
_ISA_FLAGS = {"native": (), "avx2": ("-DFLASHSERVE_NO_AVX512",), "scalar": ("-DFLASHSERVE_NO_SIMD",)}


@functools.cache
def _load(isa: str) -> Callable[..., None] | None:
    """The compiled kernel (a Python binding taking tensors), or None where it cannot be built here."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return CppPythonBindingsCodeCache.load_pybinding(list(_ARGS), _SOURCE.read_text(), needs_vec_isa=True,
                                                         extra_flags=_ISA_FLAGS[isa])
    except Exception as e:  # no compiler, an unexpected inductor version: the traced code runs instead
        log.warning("MXFP4 CPU kernel unavailable (%s: %s); using the traced products", type(e).__name__, e)
        return None


@torch.compiler.assume_constant_result  # a traced step reads the answer as a constant
def mxfp4_pairs_available() -> bool:
    """Whether :func:`mxfp4_pairs` has its compiled kernel on this machine (compiling it if needed)."""
    return _load("native") is not None


def mxfp4_pairs_eager(x: torch.Tensor, experts: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                      isa: str = "native") -> torch.Tensor:
    """Row ``p`` of ``x [P, K]`` times expert ``experts[p]``'s MXFP4 matrix: ``q [E, N, K/2]`` bytes (two E2M1
    codes each, the low nibble the even column), ``s [E, N, K/32]`` E8M0 block scales; [P, N] float32.
    ``isa`` picks one of the source's paths (:data:`ISAS`; the tests run each)."""
    E, N, half = q.shape
    if x.dim() != 2 or x.shape[1] != 2 * half or half % 16 or s.shape != (E, N, half // 16):
        raise ValueError(f"mxfp4_pairs: x {tuple(x.shape)}, q {tuple(q.shape)}, s {tuple(s.shape)} do not match")
    fn = _load(isa)
    if fn is None:
        raise RuntimeError("the MXFP4 CPU kernel could not be compiled here (see the log)")
    x = x.to(torch.float32).contiguous()
    experts = experts.to(torch.int64).contiguous().view(-1)
    out = torch.empty(x.shape[0], N, dtype=torch.float32)
    fn(x, experts, q.contiguous(), s.contiguous(), out, x.shape[0], E, N, 2 * half, torch.get_num_threads())
    return out


# the op a compiled step calls (inductor cannot trace into the binding); eager callers may use it as well
@torch.library.custom_op("flashserve::mxfp4_pairs", mutates_args=())
def mxfp4_pairs(x: torch.Tensor, experts: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """:func:`mxfp4_pairs_eager` with the CPU's own path, as an operator."""
    return mxfp4_pairs_eager(x, experts, q, s)


@mxfp4_pairs.register_fake
def _(x: torch.Tensor, experts: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], q.shape[1]), dtype=torch.float32)


__all__ = ["ISAS", "mxfp4_pairs", "mxfp4_pairs_eager", "mxfp4_pairs_available"]
