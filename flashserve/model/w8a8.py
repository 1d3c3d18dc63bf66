"""int8 x int8 products for ``--quantization w8a8``: int8 weight rows (one float32 scale per row, the ``int8``
storage) times activations quantized per token when the product runs (vLLM's and SGLang's ``w8a8_int8``;
llama.cpp's Q8_0 also multiplies 8-bit weights by activations it quantizes on the fly).

On x86 CPUs the product is fbgemm's (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``): AVX2
``vpmaddubsw`` over unsigned 8-bit activations and signed 8-bit weights, int32 sums. Measured on the
benchmark's AMD EPYC (AVX2, no AVX-512), 2 threads, a 32000x512 LM head: 0.55-0.65 ms at one row against
3.7 ms for the fp32 product on column-major weights and 5.9 ms for weight-only int8; 2.5-4.6 ms at 16 rows
against 13.6 ms. Small matrices (256x512) gain nothing: the call costs ~40 us.

Each token's activations are scaled to an absolute maximum of 1 and quantized with a fixed scale and zero
point (:data:`X_SCALE`, :data:`X_ZERO`), so a token's numbers never depend on the other rows of its batch, and
:func:`reference` computes the same numbers with plain float ops (to ~2e-7 relative: float summation order).
The cost is precision: 129 activation levels per token and one weight scale per row put a product about 1.6%
(relative) from the float one on Gaussian data, where a Q8_0 product (8-bit blocks of 32 on both sides) is
several times closer.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

# A token scaled to [-1, 1] quantizes to round(64 x) + 64, an unsigned byte in [0, 128]: 129 levels, its
# absolute maximum exactly on one. Staying at or under 128 is what keeps AVX2's vpmaddubsw exact: it sums two
# u8 x s8 products into int16, and 2 x 128 x 127 = 32512 fits where 2 x 255 x 127 saturates (measured: full
# 8-bit activations, which fbgemm's own dynamic quantization uses without reduce_range, doubled the error).
# A power-of-two step also makes the kernel's rounding (x times 1/step) the same as the reference's.
X_SCALE = 1.0 / 64.0
X_ZERO = 64

FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines  # read once, not while tracing


class Int8Kernel(OpaqueBase):
    """fbgemm's prepacked copy of one int8 matrix (its own layout; about the int8 bytes again), and the
    versions of the buffers it was packed from, so eager code can tell when the weights changed."""

    def __init__(self, q: torch.Tensor, scale_bits: torch.Tensor):
        scales = scale_bits.view(torch.float32).double()
        zeros = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated upstream; nothing a user can act on
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            qw = torch._make_per_channel_quantized_tensor(q.contiguous(), scales, zeros, 0)
        self.params = torch.ops.quantized.linear_prepack(qw, None)
        self.source = self.identity(q, scale_bits)

    @staticmethod
    def identity(q: torch.Tensor, scale_bits: torch.Tensor) -> tuple:
        """Which buffers, at which in-place version, a kernel was packed from."""
        try:
            return q.data_ptr(), q._version, scale_bits.data_ptr(), scale_bits._version
        except RuntimeError:  # inference tensors keep no version: the storage has to do
            return q.data_ptr(), None, scale_bits.data_ptr(), None

    def __getstate__(self) -> dict:
        # inductor hashes a graph's constants into its cache key by pickling them; the packed params are a
        # graph input here, not baked into the code, so their bytes are not part of the key.
        return {"kind": "fbgemm int8 matrix"}

    def __deepcopy__(self, memo: dict) -> "Int8Kernel":
        return self  # immutable; a copied layer's buffers have another identity, so it packs its own on use


register_opaque_type(Int8Kernel, typ="reference")


@torch.library.custom_op("flashserve::w8a8_mm", mutates_args=())
def _w8a8_mm(x: torch.Tensor, q: torch.Tensor, kernel: Int8Kernel) -> torch.Tensor:
    """fbgemm's product of rows ``x [M, in]`` (each scaled to absmax 1) by int8 rows ``q [out, in]``."""
    op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    return op(x, X_SCALE, X_ZERO, kernel.params)


@_w8a8_mm.register_fake
def _(x: torch.Tensor, q: torch.Tensor, kernel: Int8Kernel) -> torch.Tensor:
    return x.new_empty((x.shape[0], q.shape[0]))


def kernel_ok(x: torch.Tensor) -> bool:
    """Whether fbgemm can run the product for activations ``x`` (float32 on an x86 CPU)."""
    return FBGEMM and x.device.type == "cpu" and x.dtype == torch.float32


def _token_scale(x: torch.Tensor) -> torch.Tensor:
    """Each token's absolute maximum (1 for an all-zero token), [..., 1]."""
    a = x.abs().amax(-1, keepdim=True)
    return torch.where(a > 0, a, torch.ones_like(a))


def linear(x: torch.Tensor, q: torch.Tensor, scale_bits: torch.Tensor, kernel: Int8Kernel | None) -> torch.Tensor:
    """``x [..., in]`` times int8 rows ``q [out, in]`` (float32 ``scale`` bits per row) with ``x`` quantized
    per token: fbgemm's kernel when ``kernel`` is given and takes ``x``, else :func:`reference`."""
    if kernel is None or not kernel_ok(x):
        return reference(x, q, scale_bits)
    a = _token_scale(x)
    y = torch.ops.flashserve.w8a8_mm((x / a).reshape(-1, x.shape[-1]), q, kernel)
    return y.view(*x.shape[:-1], q.shape[0]) * a


def reference(x: torch.Tensor, q: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    """The same numbers in plain float ops: each token quantized to multiples of ``X_SCALE`` of its absmax
    (round half to even, as fbgemm), multiplied by the int8 rows, each output scaled by its row's scale."""
    a = _token_scale(x)
    xq = torch.round(x.float() / a.float() / X_SCALE) * X_SCALE
    y = F.linear(xq, q.float()) * scale_bits.view(torch.float32)
    return (y * a.float()).to(x.dtype)
