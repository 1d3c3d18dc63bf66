"""Weights kept packed in memory and dequantized where they are used (docs/engine-speed.md, "Weights as stored").

Four formats, each a pair of integer buffers so that ``model.to(dtype)`` never converts them:

* ``fp8``: E4M3 bytes ``uint8 [..., out, in]`` + one UE8M0 scale byte per ``block x block`` tile (the released
  checkpoints' dense format; V4's FP8 experts).
* ``mxfp4``: E2M1 pairs ``uint8 [..., out, in/2]`` + one UE8M0 byte per row per 32 columns (released experts).
* ``int8``: symmetric per-row ``int8 [..., out, in]`` + float32 scales kept as their bit pattern (``int32``);
  dense layers run ``torch.ops.aten._weight_int8pack_mm`` where it was timed faster at import (some AVX-512
  CPUs), :func:`int8_linear` elsewhere.
* ``w8a8``: the ``int8`` bytes; dense layers multiply them by activations quantized per token (:mod:`.w8a8`,
  fbgemm's int8 kernel on x86), experts stay weight-only ``int8``.

Dense FP8/MXFP4 dequantize the whole matrix per call (a temporary in the compute dtype); experts dequantize
only the experts a step gathers, or a few experts at a time when a step runs every expert on its rows (a
compiled CPU step decodes those in inductor's own kernels: :func:`decode_mxfp4_traced`). MXFP4 experts on a CPU
multiply decode-sized batches (eager or compiled) through :func:`cpu_kernels.mxfp4_pairs`, which decodes each
expert once for all the rows routed to it. The float model stays
the reference: :func:`dequantized_state` gives the float weights a packed model computes with, and the tests
compare the two forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from ..config import checkpoint_layout as ckpt
from ..config.checkpoint_layout import QUANTIZATIONS, checkpoint_layout
from ..config.model_config import ModelConfig
from . import blas, cpu_kernels, modes, quant, w8a8
from .modes import COMPILED, COMPILED_CPU, EAGER
from .moe import Experts, clamped_swiglu
from .norms import fp32

FP8, MXFP4, INT8, W8A8, W4A8 = "fp8", "mxfp4", "int8", "w8a8", "w4a8"
FLOAT = "float"  # unpack a packed checkpoint into the compute dtype (the reference path)
INT8_ROWS = (INT8, W8A8)  # formats stored as int8 rows + a float32 scale per row
_STORED_FP8 = ("F8_E4M3",)
_STORED_FP4 = ("I8", "U8")


@dataclass(frozen=True)
class Format:
    """A packed format: its name and the rows x columns one scale covers (int8: one row)."""

    name: str
    row_block: int = 1
    col_block: int = 0


# ---------------------------------------------------------------------------- encode / decode


def encode(w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed bytes and scales of float weights ``w [..., out, in]`` (leading dims are experts)."""
    if w.dim() > 2:
        pairs = [encode(m, fmt) for m in w.unbind(0)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    w = w.detach().to(torch.float32)
    if fmt.name == FP8:
        rows_only = fmt.row_block == 1
        q, s = quant.quantize_fp8_rows(w) if rows_only else quant.quantize_fp8_blocks(w, fmt.row_block)
        return q.view(torch.uint8), s.view(torch.uint8)
    if fmt.name == MXFP4:
        q, s = quant.quantize_mxfp4(w)
        return q.view(torch.uint8), s.view(torch.uint8)
    amax = w.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.view(torch.int32)


@modes.per_mode
def decode(q: torch.Tensor, s: torch.Tensor, fmt: Format, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Float weights ``[..., out, cols]`` in ``dtype`` from packed bytes and scales (any leading dims)."""
    if fmt.name in INT8_ROWS:
        return _int8_rows(q, s, dtype)
    scale = quant.e8m0_to_float(s)
    if fmt.name == MXFP4:
        values = quant.decode_e2m1_bytes(q)  # [..., out, 2 * packed]
        block = values.shape[-1] // scale.shape[-1]
        return (values.unflatten(-1, (-1, block)) * scale[..., None]).flatten(-2)[..., :cols].to(dtype)
    rows, rb, cb = q.shape[-2], fmt.row_block, fmt.col_block
    values = quant.decode_e4m3_bytes(q)
    if rows % rb == 0 and cols % cb == 0:  # whole tiles: broadcast each scale over its tile, no scale grid
        tiles = values.view(*q.shape[:-2], rows // rb, rb, cols // cb, cb)
        return (tiles * scale[..., :, None, :, None]).view(q.shape).to(dtype)
    grid = scale.repeat_interleave(rb, -2)[..., :rows, :].repeat_interleave(cb, -1)[..., :cols]
    return (values * grid).to(dtype)


# A compiled step on the CPU decodes through this op, an opaque call to the eager table lookups: inductor's
# own code for the decode arithmetic made MXFP4 experts slower compiled than eager, and dynamo traces the
# tables' views slowly.
@decode.variant(COMPILED_CPU)
def _decode_compiled_on_cpu(q: torch.Tensor, s: torch.Tensor, fmt: Format, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.flashserve.decode_packed(q, s, fmt.name, fmt.row_block, fmt.col_block, cols, dtype)


@torch.library.custom_op("flashserve::decode_packed", mutates_args=())
def _decode_packed(q: torch.Tensor, s: torch.Tensor, name: str, row_block: int, col_block: int, cols: int,
                   dtype: torch.dtype) -> torch.Tensor:
    with modes.running(EAGER):  # the op's body runs eagerly, whichever step calls it
        return decode(q, s, Format(name, row_block, col_block), cols, dtype)


@_decode_packed.register_fake
def _(q: torch.Tensor, s: torch.Tensor, name: str, row_block: int, col_block: int, cols: int,
      dtype: torch.dtype) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], cols), dtype=dtype)


def _int8_rows(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows times their float32 scales (stored as int32 bits), in ``dtype``."""
    return (q.to(torch.float32) * s.view(torch.float32)[..., None]).to(dtype)


def decode_mxfp4_traced(q: torch.Tensor, s: torch.Tensor, e2m1_bits: torch.Tensor, cols: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """:func:`decode` of MXFP4 written for inductor: each nibble looks its value up in ``e2m1_bits`` (the 16
    values' float32 bits), times its block's power-of-two scale, in one generated kernel: about twice as fast as
    the opaque op for what a step that runs every expert (:meth:`Experts._dense`) decodes. Gathered experts keep
    the opaque op: inductor fused this lookup into the gathered product and made it slower."""
    table = e2m1_bits.view(torch.float32)
    lo, hi = table[(q & 15).long()], table[(q >> 4).long()]  # [..., out, in / 2] each
    values = torch.stack([lo, hi], -1).flatten(-2)  # [..., out, in]: low nibble = even column
    scale = quant.e8m0_to_float(s)  # traced: the bit arithmetic
    return (values.unflatten(-1, (-1, quant.MX_BLOCK)) * scale[..., None]).flatten(-2)[..., :cols].to(dtype)


def mxfp4_pairs_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Row ``p`` of ``x [P, K]`` times its own MXFP4 matrix: ``q [P, N, K/2]`` bytes (two E2M1 codes each, the low
    nibble the even column), ``s [P, N, K/32]`` E8M0 block scales; [P, N] float32. Written for inductor (a
    compiled CPU step): the codes are decoded from their bits as they are read, multiplied with the even and the
    odd inputs, summed per 32-value block and scaled, so each expert is read once as stored and no decoded copy
    is made. Where the C++ kernel is built (:func:`cpu_kernels.mxfp4_pairs`, 4-9x faster) this is the
    fallback."""
    P, N, half = q.shape  # K a whole number of blocks
    xs = blas.materialized(fp32(x).view(P, half, 2).transpose(1, 2).contiguous())  # [P, 2, K/2]: even, odd columns
    prod = quant.e2m1_from_bits(q & 15) * xs[:, None, 0] + quant.e2m1_from_bits(q >> 4) * xs[:, None, 1]
    blocks = prod.view(P, N, -1, quant.MX_BLOCK // 2).sum(-1)  # [P, N, K/32]
    return (blocks * quant.e8m0_to_float(s)).sum(-1)


def packed_shapes(shape: tuple[int, ...], fmt: Format) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the byte and scale buffers for logical weights ``shape [..., out, in]``."""
    *lead, rows, cols = shape
    lead = tuple(lead)
    if fmt.name == FP8:
        return shape, lead + (-(-rows // fmt.row_block), -(-cols // fmt.col_block))
    if fmt.name == MXFP4:
        return lead + (rows, cols // 2), lead + (rows, -(-cols // quant.MX_BLOCK))
    return shape, lead + (rows,)


_DTYPES = {FP8: torch.uint8, MXFP4: torch.uint8, INT8: torch.int8, W8A8: torch.int8}
_SCALE_DTYPES = {FP8: torch.uint8, MXFP4: torch.uint8, INT8: torch.int32, W8A8: torch.int32}


def _int8pack_pays(rows: int, matrices: int) -> bool:
    """Whether ``torch.ops.aten._weight_int8pack_mm`` is clearly (1.25x) faster than :func:`int8_linear` at
    ``rows`` rows on this CPU, timed over ``matrices`` 1024x512 matrices (more than one, so the
    weights stream as in a step: one matrix alone in cache gave either answer from one run to the next). It has
    fast code for AVX-512 only, and even there it is faster than float32 on some CPUs and several times slower on
    others; with AVX2 only it is 3-35x slower."""
    if not torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX")):
        return False
    import time

    from threadpoolctl import threadpool_limits

    g = torch.Generator().manual_seed(0)
    qs = [torch.randint(-127, 128, (1024, 512), dtype=torch.int8, generator=g) for _ in range(matrices)]
    bits, x = torch.rand(1024, generator=g).view(torch.int32), torch.randn(rows, 512, generator=g)

    def best(product) -> float:
        times = []
        for _ in range(4):  # the first pass warms up
            t = time.perf_counter()
            for q in qs:
                product(q)
            times.append(time.perf_counter() - t)
        return min(times[1:])

    with torch.inference_mode(), threadpool_limits(limits=1, user_api="blas"):  # as the engine runs it
        kernel = best(lambda q: torch.ops.aten._weight_int8pack_mm(x, q, bits.view(torch.float32)))
        return 1.25 * kernel < best(lambda q: int8_linear(x, q, bits))


_INT8PACK: tuple[bool, bool] | None = None  # (one row, several rows): the engine's plan (use_int8pack), else timed
_INT8PACK_TIMED: tuple[bool, bool] | None = None


def int8pack_pays() -> tuple[bool, bool]:
    """Whether torch's int8 kernel pays on this CPU at one row (decode at batch 1) and at 16 (a batch), timed
    once a process (:func:`_int8pack_pays`), when the engine plans its execution or at a model's first eager
    int8 product, never while a step is traced."""
    global _INT8PACK_TIMED
    if _INT8PACK_TIMED is None:
        _INT8PACK_TIMED = (_int8pack_pays(1, matrices=16), _int8pack_pays(16, matrices=2))
    return _INT8PACK_TIMED


def use_int8pack(one_row: bool, rows: bool) -> None:
    """Run eager int8 products through torch's int8 kernel at one row / at several rows (process-wide, as the
    engine's execution plan decides: :mod:`flashserve.engine.execution`)."""
    global _INT8PACK
    _INT8PACK = (bool(one_row), bool(rows))


def _int8_kernel_ok(x: torch.Tensor) -> bool:
    """Whether ``torch.ops.aten._weight_int8pack_mm`` takes ``x`` (CPU, 16- or 32-bit floats) and pays here at
    its number of rows (:func:`use_int8pack`, :func:`int8pack_pays`); :func:`int8_linear` runs otherwise."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    one_row, rows = _INT8PACK or int8pack_pays()
    return one_row if x.numel() == x.shape[-1] else rows


# int8 rows are decoded this many values at a time by int8_linear: 2 MB of float32, which stays in cache
INT8_CHUNK_VALUES = 1 << 19


@modes.per_mode
def int8_mm(x: torch.Tensor, q: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    """``x @ (q * scale).T`` [..., out] for int8 rows ``q`` [out, in]: eager, torch's int8 kernel where it pays
    (:func:`_int8_kernel_ok`), :func:`int8_linear` elsewhere; in a compiled CPU step's one-row products
    :func:`cpu_kernels.int8_linear` on AVX2-only CPUs (inductor's code converts the bytes one at a time there),
    else inductor's."""
    if not _int8_kernel_ok(x):
        return int8_linear(x, q, scale_bits)
    flat = x.reshape(-1, q.shape[-1])
    y = torch.ops.aten._weight_int8pack_mm(flat, q, scale_bits.view(torch.float32).to(x.dtype))
    return y.view(*x.shape[:-1], q.shape[0])


@int8_mm.variant(COMPILED_CPU)
def _int8_mm_compiled_on_cpu(x: torch.Tensor, q: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    if not blas.one_row(x):
        return int8_mm.eager(x, q, scale_bits)
    if cpu_kernels.int8_pairs_preferred():
        return cpu_kernels.int8_linear(x, q, scale_bits).to(x.dtype)  # the bits as stored: no view op
    return blas.reduce_linear(x, q) * scale_bits.view(torch.float32).to(x.dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    """``x @ (q * scale).T`` for int8 rows ``q`` [out, in] and their float32 scales (stored as int32 bits):
    rows converted a cache-sized chunk at a time, each row's scale applied to its products (it factors out of
    the dot product). With AVX2 only it is faster than float32 weights and 4-40x faster than
    ``_weight_int8pack_mm``."""
    rows = max(1, INT8_CHUNK_VALUES // q.shape[-1])
    parts = [blas.linear(x, q[i:i + rows].to(x.dtype)) for i in range(0, q.shape[0], rows)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y * scale_bits.view(torch.float32).to(x.dtype)


E2M1_TABLE = "packed.e2m1_bits"  # name's end of the computed E2M1 table buffers
PACKED_BUFFERS = ("packed.qweight", "packed.scale", E2M1_TABLE)  # names' ends: not checkpoint tensors


class PackedWeights(nn.Module):
    """Packed weights ``[..., out, in]``: ``qweight`` and ``scale`` buffers, decoded on demand."""

    def __init__(self, shape: tuple[int, ...], fmt: Format):
        super().__init__()
        self.fmt, self.shape = fmt, tuple(shape)
        q_shape, s_shape = packed_shapes(self.shape, fmt)
        self.register_buffer("qweight", torch.zeros(q_shape, dtype=_DTYPES[fmt.name]))
        self.register_buffer("scale", torch.zeros(s_shape, dtype=_SCALE_DTYPES[fmt.name]))
        # the 16 E2M1 values as float32 bits: an integer buffer (model.to keeps it) of this module, so a compiled
        # step reads it as a model tensor (a module-level table would be a graph argument the direct call refuses)
        if fmt.name == MXFP4:
            self.register_buffer("e2m1_bits", torch.empty(16, dtype=torch.int32), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Compute the buffers no checkpoint holds (the E2M1 table): after ``to_empty`` too, which leaves them
        uninitialised (a model loaded from a folder is built on ``meta``)."""
        table = self._buffers.get("e2m1_bits")
        if table is not None and table.device.type != "meta":
            table.copy_(quant.e2m1_decode(torch.arange(16, dtype=torch.uint8, device=table.device)).view(torch.int32))

    @modes.per_mode
    def dequantize(self, dtype: torch.dtype, index: torch.Tensor | int | slice | None = None) -> torch.Tensor:
        """Float weights (of the experts ``index`` along the first dim when given)."""
        q, s = (self.qweight, self.scale) if index is None else (self.qweight[index], self.scale[index])
        return decode(q, s, self.fmt, self.shape[-1], dtype)

    @dequantize.variant(COMPILED_CPU)
    def _dequantize_compiled_on_cpu(self, dtype: torch.dtype,
                                 index: torch.Tensor | int | slice | None = None) -> torch.Tensor:
        # weights read in place (all of them, or a slice of experts) are decoded in inductor's own code
        if index is None or isinstance(index, slice):
            q, s = (self.qweight, self.scale) if index is None else (self.qweight[index], self.scale[index])
            if self.fmt.name == MXFP4:
                return decode_mxfp4_traced(q, s, self.e2m1_bits, self.shape[-1], dtype)
            if self.fmt.name in INT8_ROWS:  # a conversion and a product, one vectorised kernel
                return _int8_rows(q, s, dtype)
        return self.dequantize.eager(self, dtype, index)

    @torch.no_grad()
    def set_float(self, w: torch.Tensor, index: int | None = None) -> None:
        """Quantize float weights into the buffers (all of them, or expert ``index``)."""
        q, s = encode(w, self.fmt)
        (self.qweight if index is None else self.qweight[index]).copy_(q)
        (self.scale if index is None else self.scale[index]).copy_(s)

    @torch.no_grad()
    def set_stored(self, q: torch.Tensor, s: torch.Tensor, index: int | None = None) -> bool:
        """Copy a checkpoint's stored bytes as they are when they are in this format; False when not."""
        q_dst = self.qweight if index is None else self.qweight[index]
        s_dst = self.scale if index is None else self.scale[index]
        if tuple(q.shape) != tuple(q_dst.shape) or tuple(s.shape) != tuple(s_dst.shape):
            return False
        q_dst.copy_(q.view(torch.uint8) if q.dtype != torch.uint8 else q)
        s_dst.copy_(s.view(torch.uint8) if s.dtype != torch.uint8 else s)
        return True

    def adopt(self, q: torch.Tensor, s: torch.Tensor) -> bool:
        """Hold a checkpoint's stored bytes themselves (views of a mapped file: no copy) when they are this format's
        whole ``qweight`` and ``scale``; False when not."""
        if tuple(q.shape) != tuple(self.qweight.shape) or tuple(s.shape) != tuple(self.scale.shape):
            return False
        if q.element_size() != 1 or s.element_size() != 1:
            return False
        self.qweight, self.scale = q.view(self.qweight.dtype), s.view(self.scale.dtype)
        return True

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, shape={list(self.shape)}"


class _PackedMatrix(nn.Module):
    """One packed matrix; ``weight`` is it decoded into the compute dtype (for code that reads the matrix)."""

    def __init__(self, shape: tuple[int, int], fmt: Format):
        super().__init__()
        self.packed = PackedWeights(shape, fmt)
        self.compute_dtype = torch.float32

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.dequantize(self.compute_dtype)


class PackedLinear(_PackedMatrix):
    """``nn.Linear`` without bias over packed weights (the grouped output projection reads ``weight``)."""

    def __init__(self, in_features: int, out_features: int, fmt: Format):
        super().__init__((out_features, in_features), fmt)
        self.in_features, self.out_features = in_features, out_features
        self.kernel: w8a8.Int8Kernel | None = None  # w8a8 on x86: fbgemm's copy of the weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        if p.fmt.name == W8A8:
            return w8a8.linear(x, p.qweight, p.scale, self.ready_kernel())
        if p.fmt.name == INT8:
            return int8_mm(x, p.qweight, p.scale)
        if self.fp8_kernel(x):
            panels = self.current_fp8_panels()
            if panels is not None:
                return cpu_kernels.fp8_panels_linear(x, panels, p.scale, p.shape[0], p.fmt.row_block,
                                                     p.fmt.col_block).to(x.dtype)
            return cpu_kernels.fp8_linear(x, p.qweight, p.scale, p.fmt.row_block, p.fmt.col_block).to(x.dtype)
        return blas.linear(x, p.dequantize(x.dtype))

    @torch.no_grad()
    def make_fp8_panels(self) -> bool:
        """Copy this block-FP8 CPU layer's codes into the column panels :func:`cpu_kernels.fp8_panels` reads
        (:func:`cpu_kernels.pack_fp8_panels`), as the buffer ``fp8_panels``: its decode rows' products then read
        those (the engine's execution plan makes them at start-up; the copy costs the codes' bytes again). False,
        changing nothing, for another format or a row block that is not a multiple of 16; False, dropping panels
        made before, where the kernel is not available (or was refused: cpu_kernels.refuse)."""
        p = self.packed
        if (p.fmt.name != FP8 or p.qweight.device.type != "cpu" or p.qweight.dim() != 2
                or p.fmt.row_block % cpu_kernels.LANES):
            return False
        if not cpu_kernels.fp8_panels_available():
            self._buffers.pop(FP8_PANELS, None)
            return False
        if self.current_fp8_panels.eager(self) is not None:  # made already (a second engine over the model)
            return True
        self.register_buffer(FP8_PANELS, cpu_kernels.pack_fp8_panels(p.qweight[None])[0], persistent=False)
        self._fp8_panels_of = _identity(p.qweight)
        return True

    @modes.per_mode
    def current_fp8_panels(self) -> torch.Tensor | None:
        """The panels :meth:`make_fp8_panels` made, or None where there are none or the codes changed since (a
        load, a ``set_float``: the stored codes are then read as they are); a compiled step takes them as made."""
        panels = self._buffers.get(FP8_PANELS)
        if panels is None or getattr(self, "_fp8_panels_of", None) != _identity(self.packed.qweight):
            return None
        return panels

    @current_fp8_panels.variant(COMPILED)
    def _current_fp8_panels_compiled(self) -> torch.Tensor | None:
        return self._buffers.get(FP8_PANELS)

    def fp8_kernel(self, x: torch.Tensor, groups: int = 1) -> bool:
        """Whether ``x``'s product reads this layer's FP8 bytes without decoding the matrix first (the panels'
        copy through :func:`cpu_kernels.fp8_panels` where it was made, else the codes as stored through
        :func:`cpu_kernels.fp8_pairs`): block FP8 on a CPU that built the kernel, at most :data:`FP8_KERNEL_ROWS`
        rows each matrix reads (a decode step's; a prompt's rows decode the matrix once and multiply it with
        torch's product). With ``groups`` row groups (:meth:`grouped`) each group's matrix reads x's rows of that
        group: tokens, not tokens x groups."""
        fmt = self.packed.fmt
        return (fmt.name == FP8 and x.device.type == "cpu"
                and x.numel() <= FP8_KERNEL_ROWS * groups * x.shape[-1]
                and fmt.col_block % 8 == 0 and cpu_kernels.fp8_pairs_available())

    @modes.per_mode
    def ready_kernel(self) -> w8a8.Int8Kernel | None:
        """The w8a8 kernel's copy of the weights, made (again) first where the weights changed; a compiled step
        takes the one made at start-up as it is."""
        self.prepare_kernel()
        return self.kernel

    @ready_kernel.variant(COMPILED)
    def _ready_kernel_compiled(self) -> w8a8.Int8Kernel | None:
        return self.kernel

    @modes.per_mode
    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., G, in / G]`` by the weight's G row groups: int8 rows multiplied as stored (no decoded copy),
        other formats decoded."""
        p = self.packed
        G, K = x.shape[-2], x.shape[-1]
        Ng = p.shape[0] // G
        if self.fp8_kernel(x, G) and Ng % p.fmt.row_block == 0:  # group g: matrix g of the FP8 kernel
            sc = p.scale.view(G, Ng // p.fmt.row_block, -1)
            groups = torch.arange(G, device=x.device).repeat(x.numel() // (G * K))
            panels = self.current_fp8_panels()
            if panels is not None:  # a group's rows are whole panels (16 divides the row block)
                y = cpu_kernels.fp8_panels(x.reshape(-1, K), groups, panels.view(G, -1, K, cpu_kernels.LANES), sc,
                                           Ng, p.fmt.row_block, p.fmt.col_block)
            else:
                y = cpu_kernels.fp8_pairs(x.reshape(-1, K), groups, p.qweight.view(G, Ng, K), sc,
                                          p.fmt.row_block, p.fmt.col_block)
            return y.to(x.dtype).view(*x.shape[:-1], Ng)
        if p.fmt.name not in INT8_ROWS:
            return blas.grouped_linear(x, p.dequantize(x.dtype))
        return blas.grouped_linear(x, p.qweight, p.scale.view(torch.float32))

    @grouped.variant(COMPILED_CPU)
    def _grouped_compiled_on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        G, K = x.shape[-2], x.shape[-1]
        if p.fmt.name in INT8_ROWS and x.numel() == G * K and cpu_kernels.int8_pairs_preferred():
            # one token: group g is pair g of the int8 kernel (inductor's code converts the bytes one at a time
            # on AVX2-only CPUs, see int8_mm)
            q, s = p.qweight.view(G, -1, K), p.scale.view(G, -1)
            groups = torch.arange(G, device=x.device)
            return cpu_kernels.int8_pairs(x.reshape(G, K), groups, q, s).to(x.dtype).view(x.shape[:-1] + (-1,))
        return self.grouped.eager(self, x)

    def kernel_bytes(self) -> int:
        """Bytes of fbgemm's copy (w8a8): the int8 matrix again plus an int32 column sum per output (measured:
        a 16384x4096 layer grew the process by 65 MiB, its int8 bytes being 64 MiB)."""
        p = self.packed
        return p.qweight.numel() + 4 * p.shape[0] if p.fmt.name == W8A8 else 0

    def prepare_kernel(self) -> None:
        """w8a8 on an x86 CPU: pack fbgemm's copy of the weights, again when they changed since (a load, a
        ``set_float``); other formats have no kernel."""
        p = self.packed
        if p.fmt.name != W8A8 or not w8a8.FBGEMM or p.qweight.device.type != "cpu":
            return
        k = self.kernel
        if k is None or k.source != w8a8.Int8Kernel.identity(p.qweight, p.scale):
            self.kernel = w8a8.Int8Kernel(p.qweight, p.scale)


@torch.no_grad()
def join_int8_rows(module: nn.Module, group: str, paths: tuple[str, ...]) -> bool:
    """Store the int8 rows (and scales) of the weights ``paths`` of ``module`` that are ``int8`` CPU
    :class:`PackedLinear` layers one after another, in one tensor each, as the buffers ``<group>_joint_int8_q``
    and ``_s``; each layer's ``qweight`` and ``scale`` become views of them (no bytes added), and
    ``<group>_joint_int8_of`` names them with their widths: :func:`blas.joint_int8_products` then makes their
    one-row products in one kernel call. The group's other weights are left alone. False, changing nothing,
    where fewer than two such layers of one input width are in the group. A group joined before stays as it is
    (two engines over one model) while its layers are still views of its rows."""
    joined = getattr(module, group + blas.INT8_JOINT + "_of", None)
    rows = getattr(module, group + blas.INT8_JOINT + "_q", None)
    if joined is not None and all(_within(_int8_layer(module, p).qweight, rows) for p in joined[0]):
        return True
    layers = [(path, w) for path in paths if (w := _int8_layer(module, path)) is not None]
    if len(layers) < 2 or len({p.qweight.shape[-1] for _, p in layers}) != 1:
        return False
    q = torch.cat([p.qweight for _, p in layers])
    s = torch.cat([p.scale for _, p in layers])
    start = 0
    for _, p in layers:
        n = p.qweight.shape[0]
        p._buffers["qweight"], p._buffers["scale"] = q[start:start + n], s[start:start + n]
        start += n
    module.register_buffer(group + blas.INT8_JOINT + "_q", q, persistent=False)
    module.register_buffer(group + blas.INT8_JOINT + "_s", s, persistent=False)
    setattr(module, group + blas.INT8_JOINT + "_of",
            (tuple(path for path, _ in layers), tuple(p.qweight.shape[0] for _, p in layers)))
    return True


def _int8_layer(module: nn.Module, path: str) -> PackedWeights | None:
    """The packed weights at ``path`` (``"<layer>.weight"``) of ``module`` if they are an int8 CPU
    :class:`PackedLinear`'s, else None. Exactly PackedLinear: a row-parallel subclass reduces its output across
    ranks in its own forward."""
    try:
        mod = module.get_submodule(path.removesuffix(".weight"))
    except AttributeError:
        return None
    ok = (path.endswith(".weight") and type(mod) is PackedLinear and mod.packed.fmt.name == INT8
          and mod.packed.qweight.device.type == "cpu")
    return mod.packed if ok else None


def _within(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


class PackedEmbedding(_PackedMatrix):
    """``nn.Embedding`` over packed rows (engram tables): gathers the rows a step reads, then dequantizes."""

    def __init__(self, rows: int, dim: int, fmt: Format):
        super().__init__((rows, dim), fmt)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.packed  # row-wise formats only: each gathered row decodes as a one-row matrix
        rows = decode(p.qweight[ids][..., None, :], p.scale[ids][..., None, :], p.fmt, p.shape[-1], self.compute_dtype)
        return rows[..., 0, :]


# Packed experts (see PackedExperts.forward): every expert runs on every row while the matmuls of rows not routed
# to an expert stay under LOOP_EXPERT_MACS per expert (about what the per-expert loop's ops cost on this CPU)
# and decoding every expert stays under DECODE_BYTES.
# Prompts (more than DENSE_MAX_ROWS rows) always take the loop, whose per-expert products are the float
# experts' own: a packed checkpoint's prefill equals the unpacked one's bit for bit.
LOOP_EXPERT_MACS = 2 << 20
INT8_KERNEL_PAIRS = 8  # a compiled step's int8 pair products through cpu_kernels.int8_pairs: one token's (measured)
DECODE_BYTES = 64 << 20
DENSE_MAX_ROWS = 32
# block-FP8 dense layers of this many rows or fewer multiply their bytes as stored (cpu_kernels.fp8_pairs): one
# row of V4.1-Flash's 8192x4096 output projection 3.0 ms against 202 decoding it first; 16 rows 12.6 against 217
FP8_KERNEL_ROWS = 64


class PackedExperts(Experts):
    """Routed experts over packed ``w1``/``w2``/``w3``: each step dequantizes only the experts it gathers."""

    # MXFP4 products through the CPU kernel on activations quantized to 8 bits a 32-block (--quantization w4a8;
    # set by the loader, :func:`activations_in_8_bits`); False: exact
    int8_activations = False

    def __init__(self, n: int, dim: int, inter: int, limit: float, fmt: Format):
        nn.Module.__init__(self)
        self.n_experts, self.dim, self.inter, self.limit = n, dim, inter, limit
        self.first = 0  # checkpoint id of expert 0 here (see Experts)
        self.w1_packed = PackedWeights((n, inter, dim), fmt)
        self.w2_packed = PackedWeights((n, dim, inter), fmt)
        self.w3_packed = PackedWeights((n, inter, dim), fmt)

    def expert_weights(self, name: str, dtype: torch.dtype,
                       index: torch.Tensor | int | slice | None = None) -> torch.Tensor:
        return getattr(self, f"{name}_packed").dequantize(dtype, index)

    def expert_mm(self, name: str, h: torch.Tensor, e: int) -> torch.Tensor:
        p = getattr(self, f"{name}_packed")
        if p.fmt.name == INT8:
            return int8_mm(h, p.qweight[e], p.scale[e])
        return super().expert_mm(name, h, e)

    def reads_in_place(self) -> bool:
        """int8 rows and MXFP4 bytes are multiplied as stored in a compiled CPU step (see :meth:`pair_products`)."""
        return self.w1_packed.fmt.name in (INT8, MXFP4)

    def mxfp4_kernel(self, x: torch.Tensor) -> bool:
        """Whether the pairs' products run :func:`cpu_kernels.mxfp4_pairs` (MXFP4 on a CPU that built it)."""
        return (self.w1_packed.fmt.name == MXFP4 and x.device.type == "cpu" and self.dim % quant.MX_BLOCK == 0
                and self.inter % quant.MX_BLOCK == 0 and cpu_kernels.mxfp4_pairs_available())

    @modes.per_mode
    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= DENSE_MAX_ROWS and self.mxfp4_kernel(x):  # decode-sized batches take the MXFP4 kernel
            return self._gathered(x, idx, w)
        # More (row, expert) pairs than experts, a few rows (a verification step, a small batch): the loop over
        # hit experts pays ~10 ops and a host sync per expert, gathering would decode more than every expert;
        # decoding every expert once and running each on every row costs 3 decodes plus the matmuls of rows
        # not routed there, worth it while those stay under LOOP_EXPERT_MACS per expert. 1 thread, MoE ms:
        # default model (8 x 256x128, top-2) 6 rows 1.6 vs loop 4.7; peers (16 x 256x512, top-4) 6 rows 15.8
        # vs 13.7, 16 rows 17.8 vs 20.8 (glibc trimming its heap; noisy).
        pairs, rows = idx.numel(), x.shape[0]
        matrices = 3 * self.inter * self.dim  # values (and MACs per row) of one expert
        wasted = (self.n_experts * rows - pairs) * matrices
        if (self.n_experts < pairs and rows <= DENSE_MAX_ROWS and wasted <= self.n_experts * LOOP_EXPERT_MACS
                and self.n_experts * matrices * x.element_size() <= DECODE_BYTES):
            return self._dense(x, idx, w)
        return super().forward(x, idx, w)

    @forward.variant(COMPILED_CPU)
    def _forward_compiled_on_cpu(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.reads_in_place():  # int8 rows and MXFP4 bytes multiplied as stored
            return self._gathered(x, idx, w)
        return self.forward.eager(self, x, idx, w)

    def _grouped_mm_ok(self, x: torch.Tensor) -> bool:
        return False  # it would decode every expert each step; the loop decodes only the experts hit

    @modes.per_mode
    def gate_up_products(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With the MXFP4 kernel, or the int8 kernel in a compiled CPU step (:meth:`int8_kernel`), one call over
        the tokens' rows (each read once for its k pairs, no [pairs, D] copy), the same sums as two
        :meth:`pair_products` calls; otherwise :meth:`Experts.gate_up_products`."""
        if not self.mxfp4_kernel(x):
            return super().gate_up_products(x, idx)
        w1, w3 = self.w1_packed, self.w3_packed
        gate_up = cpu_kernels.mxfp4_gate_up(x, idx, w1.qweight, w1.scale, w3.qweight, w3.scale,
                                            self.int8_activations).to(x.dtype)
        return gate_up[0], gate_up[1]

    @gate_up_products.variant(COMPILED_CPU)
    def _gate_up_products_compiled_on_cpu(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.int8_kernel(idx):
            return self.gate_up_products.eager(self, x, idx)
        w1, w3 = self.w1_packed, self.w3_packed
        gate_up = cpu_kernels.int8_gate_up(x, idx, w1.qweight, w1.scale, w3.qweight, w3.scale).to(x.dtype)
        return gate_up[0], gate_up[1]

    def int8_kernel(self, experts: torch.Tensor) -> bool:
        """Whether a compiled CPU step's int8 pair products of ``experts`` (one index a pair) run
        :func:`cpu_kernels.int8_pairs`: int8 experts, a static count of pairs, at most :data:`INT8_KERNEL_PAIRS`
        (one token's; a dynamic count would be guarded on), on a CPU that prefers the kernel."""
        return (self.w1_packed.fmt.name == INT8 and isinstance(experts.numel(), int)
                and experts.numel() <= INT8_KERNEL_PAIRS and cpu_kernels.int8_pairs_preferred())

    @modes.per_mode
    def pair_products(self, name: str, h: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """int8: a row scale factors out of its dot product, so each gathered expert is only converted, and
        the [pairs, out] products are scaled (one pass less over the weights than decoding them first). MXFP4 on
        a CPU: :func:`cpu_kernels.mxfp4_pairs` (each expert decoded once for its rows); in a compiled CPU step
        without it, :func:`mxfp4_pairs_linear`, the bytes decoded as they are read."""
        p = getattr(self, f"{name}_packed")
        if self.mxfp4_kernel(h):
            return cpu_kernels.mxfp4_pairs(h, experts, p.qweight, p.scale, self.int8_activations).to(h.dtype)
        if p.fmt.name != INT8:
            return super().pair_products(name, h, experts)
        return blas.pairs_linear(h, p.qweight[experts], p.scale[experts].view(torch.float32))

    @pair_products.variant(COMPILED_CPU)
    def _pair_products_compiled_on_cpu(self, name: str, h: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        p = getattr(self, f"{name}_packed")
        if p.fmt.name == MXFP4 and not self.mxfp4_kernel(h) and p.shape[-1] % quant.MX_BLOCK == 0:
            return mxfp4_pairs_linear(h, p.qweight[experts], p.scale[experts]).to(h.dtype)
        if self.int8_kernel(experts):
            return cpu_kernels.int8_pairs(h, experts, p.qweight, p.scale).to(h.dtype)
        return self.pair_products.eager(self, name, h, experts)


# ---------------------------------------------------------------------------- which tensors, which format


TABLE_FP8 = Format(FP8, 1, quant.MX_BLOCK)  # engram tables: FP8 rows, a scale per row per 32 columns
EXPERT_FP4 = Format(MXFP4, 1, quant.MX_BLOCK)
ROW_INT8 = Format(INT8)
ROW_W8A8 = Format(W8A8)


def plan(cfg: ModelConfig, method: str) -> dict[str, Format]:
    """Module path -> format for quantization ``method`` (see :data:`QUANTIZATIONS`).

    ``mxfp4`` is the released layout (dense FP8 blocks, MXFP4 experts, FP8 engram tables); ``fp8`` puts the
    experts in FP8 blocks too (V4's base layout); ``int8`` covers the same dense layers and experts and the
    LM head, per row, leaving the engram tables float; ``w8a8`` is ``int8`` with the dense layers and the head
    multiplying activations quantized per token (the experts' products stay weight-only: a compiled step picks
    them by tensor index, which fbgemm's per-matrix kernels cannot take). ``w4a8`` stores as ``mxfp4`` does; the
    loader then sets the MXFP4 experts to multiply activations quantized to 8 bits (:func:`activations_in_8_bits`).
    """
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if method == FLOAT:
        return {}
    block = cfg.quantization.weight_block_size
    dense = {INT8: ROW_INT8, W8A8: ROW_W8A8}.get(method, Format(FP8, block, block))
    experts = {INT8: ROW_INT8, W8A8: ROW_INT8, FP8: dense, MXFP4: EXPERT_FP4, W4A8: EXPERT_FP4}[method]
    out: dict[str, Format] = {}
    for spec in checkpoint_layout(cfg):
        if spec.kind not in (ckpt.FP8, ckpt.FP4, ckpt.FP8_TABLE) or not spec.name.endswith(".weight"):
            continue
        path = spec.name[: -len(".weight")]
        if ".experts." in path:
            out[path.split(".experts.")[0] + ".experts"] = experts
        elif spec.kind == ckpt.FP8_TABLE:
            if method not in INT8_ROWS:
                out[path] = TABLE_FP8
        else:
            out[path] = dense
    if method in INT8_ROWS:
        out["head"] = dense
    return out


def plan_as_stored(cfg: ModelConfig, stored: Mapping[str, str]) -> dict[str, Format]:
    """Module path -> format keeping a checkpoint as it is stored: ``stored`` maps the released names of the
    tensors stored with a scale to their stored dtype (``F8_E4M3``: FP8 blocks or table rows; ``I8``/``U8``:
    MXFP4). Everything else stays float; experts are packed when their first expert is."""
    block = cfg.quantization.weight_block_size
    out: dict[str, Format] = {}
    for spec in checkpoint_layout(cfg):
        dtype = stored.get(spec.name)
        if dtype is None or not spec.name.endswith(".weight"):
            continue
        path = spec.name[: -len(".weight")]
        if ".experts." in path:
            if ".experts.0.w1." in spec.name:
                fmt = EXPERT_FP4 if dtype in _STORED_FP4 else Format(FP8, block, block)
                out[path.split(".experts.")[0] + ".experts"] = fmt
        elif spec.kind == ckpt.FP8_TABLE:
            out[path] = TABLE_FP8
        elif dtype in _STORED_FP8:
            out[path] = Format(FP8, block, block)
    return out


def _packed_module(module: nn.Module, fmt: Format) -> nn.Module:
    if isinstance(module, Experts):
        n, inter, dim = module.w1.shape
        return PackedExperts(n, dim, inter, module.limit, fmt)
    if isinstance(module, nn.Embedding):
        return PackedEmbedding(module.num_embeddings, module.embedding_dim, fmt)
    if isinstance(module, nn.Linear) and module.bias is None:
        return PackedLinear(module.in_features, module.out_features, fmt)
    raise TypeError(f"cannot pack a {type(module).__name__}")


@torch.no_grad()
def pack_model(model: nn.Module, formats: Mapping[str, Format], *, quantize: bool,
               compute_dtype: torch.dtype) -> nn.Module:
    """Replace the modules named in ``formats`` by packed ones, in place.

    ``quantize=True`` encodes each module's current float weights; ``quantize=False`` builds empty packed
    buffers on the module's device (on ``meta`` before a checkpoint is loaded into them). Paths absent from
    ``model`` (drafters that were not built) are skipped.
    """
    for path, fmt in formats.items():
        try:
            old = model.get_submodule(path)
        except AttributeError:
            continue
        device = next(old.parameters()).device
        with torch.device(device):
            new = _packed_module(old, fmt)
        if hasattr(new, "compute_dtype"):
            new.compute_dtype = compute_dtype
        if quantize:
            if isinstance(new, PackedExperts):
                for name in ("w1", "w2", "w3"):
                    getattr(new, f"{name}_packed").set_float(getattr(old, name))
            else:
                new.packed.set_float(old.weight)
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model


def streamed_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Paths (each with its dot) of the modules whose tensors are slots filled while serving, not checkpoint tensors
    (engram row caches: :mod:`flashserve.model.row_cache`)."""
    return tuple(f"{p}." for p, m in model.named_modules() if getattr(m, "streamed_from_checkpoint", False))


def packed_destinations(model: nn.Module) -> dict[str, "PackedSlot"]:
    """Released checkpoint name -> packed destination, for every packed module of ``model``."""
    out: dict[str, PackedSlot] = {}
    slots = streamed_prefixes(model)
    for path, module in model.named_modules():
        if path.startswith(slots):
            continue
        if isinstance(module, PackedExperts):
            for name in ("w1", "w2", "w3"):
                weights = getattr(module, f"{name}_packed")
                for e in range(module.n_experts):
                    out[f"{path}.{module.first + e}.{name}.weight"] = PackedSlot(weights, e)
        elif isinstance(module, (PackedLinear, PackedEmbedding)):
            out[f"{path}.weight"] = PackedSlot(module.packed, None)
        elif hasattr(module, "matrices"):  # mapped_experts.MappedExperts: one destination an expert's matrix
            for name in module.matrices:
                for e in range(module.n_experts):
                    out[f"{path}.{module.first + e}.{name}.weight"] = module.slot(e, name)
    return out


class PackedSlot:
    """A checkpoint destination in packed form: stored bytes in the same format are copied as they are,
    anything else is decoded to float by the loader and quantized here."""

    def __init__(self, weights: PackedWeights, index: int | None):
        self.weights, self.index = weights, index
        self.shape = weights.shape[1:] if index is not None else weights.shape
        self.dtype = torch.float32  # what the loader decodes into when the formats differ

    def accepts(self, stored_dtype: str, row_block: int, col_block: int) -> bool:
        """Whether a stored tensor of this dtype and scale grid is this slot's format, byte for byte."""
        fmt = self.weights.fmt
        stored = {FP8: _STORED_FP8, MXFP4: _STORED_FP4}.get(fmt.name, ())
        return stored_dtype in stored and (row_block, col_block) == (fmt.row_block, fmt.col_block)

    def set_stored(self, q: torch.Tensor, s: torch.Tensor) -> bool:
        return self.weights.set_stored(q, s, self.index)

    def adopt(self, q: torch.Tensor, s: torch.Tensor) -> bool:
        """Hold the stored bytes themselves (a whole matrix only: an expert's are a slice of a stacked buffer)."""
        return self.index is None and self.weights.adopt(q, s)

    def nbytes(self) -> int:
        """Bytes this destination holds, packed."""
        w, i = self.weights, self.index
        q, s = (w.qweight, w.scale) if i is None else (w.qweight[i], w.scale[i])
        return q.numel() * q.element_size() + s.numel() * s.element_size()

    def set_float(self, w: torch.Tensor) -> None:
        self.weights.set_float(w, self.index)


def dequantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Released name -> the float weights a packed model computes with (float32), for the reference forward."""
    return {name: slot.weights.dequantize(torch.float32, slot.index) for name, slot in
            packed_destinations(model).items()}


FP8_PANELS = "fp8_panels"  # a block-FP8 layer's panel copy of its codes (PackedLinear.make_fp8_panels)


def _identity(t: torch.Tensor) -> tuple[int, int | None]:
    """Where ``t``'s values are and how often they were written in place: a copy made from it is current while
    this is unchanged (an inference tensor keeps no version: its storage has to do, as w8a8's kernels do)."""
    try:
        return t.data_ptr(), t._version
    except RuntimeError:
        return t.data_ptr(), None


def make_fp8_panels(model: nn.Module) -> list[str]:
    """Give every block-FP8 CPU layer of ``model`` the panel copy of its codes that its decode rows' products read
    (:meth:`PackedLinear.make_fp8_panels`); returns the panels' names."""
    return [f"{name}.{FP8_PANELS}" for name, m in model.named_modules()
            if isinstance(m, PackedLinear) and m.make_fp8_panels()]


def prepare_kernels(model: nn.Module) -> int:
    """Make every w8a8 layer's kernel copy of its weights (before a step is compiled); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.packed.fmt.name == W8A8]
    for m in layers:
        m.prepare_kernel()
    return sum(m.kernel is not None for m in layers)


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, computed tables (RoPE, engram hashing, E2M1 values) excluded, and
    of the w8a8 kernels' copies made so far (joined int8 rows once: the layers' bytes are views of them)."""
    total = sum(m.kernel_bytes() for m in model.modules() if isinstance(m, PackedLinear) and m.kernel is not None)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if (not name.startswith(("rope.", "engram_hasher."))
                and not name.endswith((E2M1_TABLE, *blas.INT8_JOINT_BUFFERS))):
            total += t.numel() * t.element_size()
    return total


__all__ = ["QUANTIZATIONS", "INT8", "W8A8", "FP8", "MXFP4", "FLOAT", "Format", "PackedLinear", "PackedEmbedding",
           "PackedExperts", "PackedSlot", "plan", "plan_as_stored", "pack_model", "packed_destinations",
           "dequantized_state", "prepare_kernels", "resident_bytes", "encode", "decode"]
