"""Low-precision formats of DeepSeek-V4 / V4.1 (docs/architecture.md#numerics-and-quantisation-points,
#kv-cache, #checkpoint-names).

Three families, all sharing one set of encoders so they agree bit for bit:

* QAT fake-quant (quantise -> dequantise, same shape and dtype): :func:`fake_quant_fp8`, :func:`fake_quant_fp4`.
* Released checkpoint weight formats: block FP8 (:func:`quantize_fp8_blocks`), MXFP4 experts
  (:func:`quantize_mxfp4`) and FP8 tables with per-row, per-32-column scales (:func:`quantize_fp8_rows`),
  each with its dequantiser.
* Packed KV records for a byte-level cache: :func:`pack_fp4_e4m3` (288 B for 512 values),
  :func:`pack_fp4_ue8m0` (68 B for 128), :func:`pack_fp8_ue8m0` (528 B for 512); ``unpack_*(pack_*(x))``
  equals the matching fake-quant exactly.

Conventions: scales are powers of two (UE8M0: byte ``b`` means ``2^(b-127)``) except NVFP4-style E4M3 scales;
E2M1 codes are ``sign << 3 | magnitude code`` with magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; two codes per byte,
low nibble = even column. Everything is computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import modes
from .modes import COMPILED

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_BIAS = 127
MX_BLOCK = 32  # MXFP4 / FP8-table scale group (columns)

# E2M1 magnitudes by code 0..7: 0, .5, 1, 1.5, 2, 3, 4, 6.
# Round-to-nearest thresholds between consecutive magnitudes; a value equal to a threshold goes to the even
# code. Ties at 0.25, 1.25, 2.5, 5 go down (to codes 0, 2, 4, 6), ties at 0.75, 1.75, 3.5 go up (codes 2, 4, 6).
_E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)

FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = torch.float8_e8m0fnu


# ---------------------------------------------------------------------------- scalar helpers


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(v))`` (int32) for positive finite float32 ``v`` (no log2 rounding at powers of two)."""
    mantissa, exponent = torch.frexp(v)
    return exponent - (mantissa == 0.5).to(exponent.dtype)


def e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """Decode UE8M0 bytes (``uint8`` or ``float8_e8m0fnu``) to float32 ``2^(b-127)``, built from the bits (exact)."""
    b = b.view(torch.uint8) if b.dtype == E8M0_DTYPE else b
    if b.dtype != torch.uint8:
        raise TypeError(f"e8m0 scales must be uint8 or float8_e8m0fnu, got {b.dtype}")
    return _e8m0_values(b)


@modes.per_mode
def _e8m0_values(b: torch.Tensor) -> torch.Tensor:
    if b.device.type == "cpu":  # one gather instead of five ops (see the tables below)
        return _E8M0_VALUES.index_select(0, b.reshape(-1).long()).view(b.shape)
    return _e8m0_arithmetic(b)


# Traced code keeps the arithmetic: tracing the tables' dtype views over symbolic sizes cost dynamo 30 s per graph
# (a compiled CPU step calls the tables through ``packed.decode``'s opaque op instead)
@_e8m0_values.variant(COMPILED)
def _e8m0_values_compiled(b: torch.Tensor) -> torch.Tensor:
    return _e8m0_arithmetic(b)


def _e8m0_arithmetic(b: torch.Tensor) -> torch.Tensor:
    b32 = b.to(torch.int32)
    normal = (b32 << 23).view(torch.float32)  # byte 0 gives +0 here; 2^-127 is subnormal
    return torch.where(b32 == 0, torch.full_like(normal, 2.0 ** -127), normal)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2^e`` (float32, exact) for int exponents in [-127, 127]."""
    return e8m0_to_float((exponent + E8M0_BIAS).to(torch.uint8))


def _e8m0_bytes(exponent: torch.Tensor) -> torch.Tensor:
    """UE8M0 storage (``float8_e8m0fnu``) of power-of-two exponents."""
    return (exponent + E8M0_BIAS).clamp(0, 254).to(torch.uint8).view(E8M0_DTYPE)


def _scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale as float32 multipliers: E8M0/uint8 bytes are exponents, floating scales are values."""
    if scale.dtype in (E8M0_DTYPE, torch.uint8):
        return e8m0_to_float(scale)
    return scale.to(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 view ``[..., d/block, block]`` of the last dimension."""
    return x.to(torch.float32).unflatten(-1, (-1, block))


# ---------------------------------------------------------------------------- E2M1 codes


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to E2M1 codes (uint8 in 0..15, sign in bit 3).

    Round to nearest, ties to the even code; magnitudes above 6 saturate to 6.
    """
    mag = v.abs()
    # the magnitude code counts the thresholds passed: strictly for ties-down ones, inclusively for ties-up ones
    code = torch.signbit(v).to(torch.uint8) * 8
    for t in _E2M1_TIES_DOWN:
        code += mag > t
    for t in _E2M1_TIES_UP:
        code += mag >= t
    return code


def e2m1_from_bits(codes: torch.Tensor) -> torch.Tensor:
    """:func:`e2m1_decode` as integer arithmetic on the float32 bits, for inductor: magnitude code ``c`` (3 bits)
    is ``(c + 252) << 22`` from 2 up (exponent ``e + 126``, the mantissa's top bit ``m``), 0.5 at 1, 0 at 0.
    Compiled on the CPU this is vectorised; :func:`e2m1_decode`'s float ``where`` chain from uint8 codes was not
    (an MXFP4 expert layer at 16 rows took 67 ms that way, 3.9 ms this way)."""
    c = codes.to(torch.int32)
    mag = c & 7
    bits = torch.where(mag == 1, 252 << 22, (mag + 252) << 22) & -(mag != 0).to(torch.int32)
    return (bits | ((c & 8) << 28)).view(torch.float32)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8 0..15): magnitude codes 0-3 -> m/2, 4-5 -> m-2, 6-7 -> 2m-8.

    The device path (and the tables' source); on the CPU :func:`decode_e2m1_bytes` looks values up instead.
    """
    m = (codes & 7).to(torch.float32)
    mag = torch.where(m < 4, m * 0.5, torch.where(m < 6, m - 2, m * 2 - 8))
    return torch.where(codes >= 8, -mag, mag)


def e2m1_pair_table() -> torch.Tensor:
    """[256, 2] float32: the two E2M1 values (low nibble first) of every byte."""
    b = torch.arange(256, dtype=torch.uint8)
    return torch.stack([e2m1_decode(b & 15), e2m1_decode(b >> 4)], dim=-1)


# Decoding by table on the CPU: one gather per tensor against a 256-entry table. 1 thread, AVX2: eight 256x128
# MXFP4 experts 0.13 ms against 5.0 for the E2M1 arithmetic and unpacking (0.76 when the table's rows are
# [2] floats: hence each entry is a byte's two float32 values read as one float64); a 4096x128 FP8 matrix 0.85
# ms against 3.1 for torch's float8 -> float32 conversion, which has no vector path on the CPU. Constant
# tables, eager CPU only (the functions' compiled modes, :mod:`.modes`): compiled, the arithmetic fuses; on CUDA a host table would have to be
# copied inside a graph.
_E2M1_PAIRS = e2m1_pair_table().view(torch.float64).view(256)  # [256]: (low nibble, high nibble) as float32 pairs
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(torch.float32)  # [256] float32
_E8M0_VALUES = _e8m0_arithmetic(torch.arange(256, dtype=torch.uint8))  # [256] float32


@modes.per_mode
def decode_e2m1_bytes(packed: torch.Tensor) -> torch.Tensor:
    """float32 values ``[..., 2n]`` of packed E2M1 pairs ``uint8 [..., n]`` (low nibble = even column)."""
    p = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    if p.device.type != "cpu":
        return e2m1_decode(unpack_nibbles(p))
    return _E2M1_PAIRS.index_select(0, p.reshape(-1).int()).view(torch.float32).view(*p.shape[:-1], 2 * p.shape[-1])


@decode_e2m1_bytes.variant(COMPILED)
def _decode_e2m1_bytes_compiled(packed: torch.Tensor) -> torch.Tensor:
    p = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    return e2m1_decode(unpack_nibbles(p))


@modes.per_mode
def decode_e4m3_bytes(b: torch.Tensor) -> torch.Tensor:
    """float32 values of E4M3 bytes (``uint8`` or ``float8_e4m3fn``), same shape."""
    if b.device.type != "cpu":
        return b.view(FP8_DTYPE).to(torch.float32)
    return _E4M3_VALUES.index_select(0, b.view(torch.uint8).reshape(-1).long()).view(b.shape)


@decode_e4m3_bytes.variant(COMPILED)
def _decode_e4m3_bytes_compiled(b: torch.Tensor) -> torch.Tensor:
    return b.view(FP8_DTYPE).to(torch.float32)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim (even index -> low nibble). Last dim must be even."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of 4-bit codes ({codes.shape[-1]})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 codes ``[..., 2n]``."""
    p = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    return torch.stack([p & 0x0F, p >> 4], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------- block encoders (shared)


def _fp8_pow2_blocks(xb: torch.Tensor, amax_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values and power-of-two exponents for float32 blocks ``[..., n, b]``.

    ``scale = 2^ceil(log2(max(amax, amax_floor) / 448))``.
    """
    amax = xb.abs().amax(-1, keepdim=True)
    exponent = _ceil_log2(amax.clamp_min(amax_floor) / E4M3_MAX)
    q = (xb / _pow2(exponent)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, exponent.squeeze(-1)


def _fp4_blocks(xb: torch.Tensor, e4m3_scale: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E2M1 codes, float32 scales and stored scale bytes (uint8) for float32 blocks ``[..., n, b]``.

    ``e4m3_scale``: scale = e4m3(max(amax, 6·2^-9) / 6) (NVFP4 without the tensor scale);
    otherwise scale = 2^ceil(log2(max(amax, 6·2^-126) / 6)) (UE8M0).
    """
    amax = xb.abs().amax(-1, keepdim=True)
    if e4m3_scale:
        s8 = (amax.clamp_min(E2M1_MAX * 2.0 ** -9) / E2M1_MAX).clamp_max(E4M3_MAX).to(FP8_DTYPE)
        scale, stored = s8.to(torch.float32), s8.view(torch.uint8)
    else:
        exponent = _ceil_log2(amax.clamp_min(E2M1_MAX * 2.0 ** -126) / E2M1_MAX)
        scale, stored = _pow2(exponent), (exponent + E8M0_BIAS).to(torch.uint8)
    return e2m1_encode(xb / scale), scale, stored.squeeze(-1)


# ---------------------------------------------------------------------------- QAT fake-quant


def fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8-E4M3 quantise->dequantise with one power-of-two scale per ``block`` channels of the last dim.

    ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``. Returns ``x`` unchanged if the last dim is not a
    multiple of ``block`` (as mlx-lm and transformers do).
    """
    if x.shape[-1] % block:
        return x
    q, exponent = _fp8_pow2_blocks(_blocks(x, block), 1e-4)
    return (q.to(torch.float32) * _pow2(exponent).unsqueeze(-1)).flatten(-2).to(x.dtype)


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    """FP4-E2M1 quantise->dequantise per ``block`` channels of the last dim (see :func:`_fp4_blocks` for scales).

    The model (docs/architecture.md#numerics-and-quantisation-points) uses ``block=16, e4m3_scale=True`` for the
    compressed main latent and ``block=32, e4m3_scale=False`` for index queries/keys. ``x`` is returned unchanged if the
    last dim is not a multiple of ``block``.
    """
    if x.shape[-1] % block:
        return x
    codes, scale, _ = _fp4_blocks(_blocks(x, block), e4m3_scale)
    return (e2m1_decode(codes) * scale).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------- packed KV records


def _check_multiple(d: int, block: int, what: str) -> None:
    if d % block:
        raise ValueError(f"{what}: last dim {d} is not a multiple of {block}")


def _record_dim(nbytes: int, num: int, den: int, what: str) -> int:
    """Value count ``d`` of a record of ``nbytes = d * num / den`` bytes."""
    if (nbytes * den) % num:
        raise ValueError(f"{what}: a record of {nbytes} bytes does not hold a whole number of values")
    return nbytes * den // num


def pack_fp4_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x[..., d]`` as E2M1 pairs + one E4M3 scale per 16: ``uint8[..., d/2 + d/16]`` (288 B for d=512)."""
    _check_multiple(x.shape[-1], 16, "pack_fp4_e4m3")
    codes, _, stored = _fp4_blocks(_blocks(x, 16), e4m3_scale=True)
    return torch.cat([pack_nibbles(codes.flatten(-2)), stored], dim=-1)


def unpack_fp4_e4m3(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_fp4_e4m3` (values in ``dtype``)."""
    d = _record_dim(packed.shape[-1], 9, 16, "unpack_fp4_e4m3")
    codes = unpack_nibbles(packed[..., : d // 2]).unflatten(-1, (-1, 16))
    scale = packed[..., d // 2:].contiguous().view(FP8_DTYPE).to(torch.float32).unsqueeze(-1)
    return (e2m1_decode(codes) * scale).flatten(-2).to(dtype)


def pack_fp4_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x[..., d]`` as E2M1 pairs + one UE8M0 scale per 32: ``uint8[..., d/2 + d/32]`` (68 B for d=128)."""
    _check_multiple(x.shape[-1], 32, "pack_fp4_ue8m0")
    codes, _, stored = _fp4_blocks(_blocks(x, 32), e4m3_scale=False)
    return torch.cat([pack_nibbles(codes.flatten(-2)), stored], dim=-1)


def unpack_fp4_ue8m0(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_fp4_ue8m0` (values in ``dtype``)."""
    d = _record_dim(packed.shape[-1], 17, 32, "unpack_fp4_ue8m0")
    codes = unpack_nibbles(packed[..., : d // 2]).unflatten(-1, (-1, 32))
    scale = e8m0_to_float(packed[..., d // 2:]).unsqueeze(-1)
    return (e2m1_decode(codes) * scale).flatten(-2).to(dtype)


def pack_fp8_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x[..., d]`` as E4M3 bytes + one UE8M0 scale per 32: ``uint8[..., d + d/32]`` (528 B for d=512).

    Same numerics as :func:`fake_quant_fp8` with ``block=32``.
    """
    _check_multiple(x.shape[-1], 32, "pack_fp8_ue8m0")
    q, exponent = _fp8_pow2_blocks(_blocks(x, 32), 1e-4)
    return torch.cat([q.flatten(-2).view(torch.uint8), (exponent + E8M0_BIAS).to(torch.uint8)], dim=-1)


def unpack_fp8_ue8m0(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_fp8_ue8m0` (values in ``dtype``)."""
    d = _record_dim(packed.shape[-1], 33, 32, "unpack_fp8_ue8m0")
    q = packed[..., :d].contiguous().view(FP8_DTYPE).to(torch.float32).unflatten(-1, (-1, 32))
    scale = e8m0_to_float(packed[..., d:]).unsqueeze(-1)
    return (q * scale).flatten(-2).to(dtype)


# ---------------------------------------------------------------------------- checkpoint weight formats


def _pad_to(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor up to ``[rows, cols]``."""
    return F.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))


def _expand_scale(scale: torch.Tensor, row_block: int, col_block: int, rows: int, cols: int) -> torch.Tensor:
    """Per-element float32 multipliers ``[rows, cols]`` from a block scale grid."""
    s = _scale_to_float(scale)
    return s.repeat_interleave(row_block, 0)[:rows].repeat_interleave(col_block, 1)[:, :cols]


def _check_2d(w: torch.Tensor, what: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{what} expects a 2-D weight, got shape {tuple(w.shape)}")


def quantize_fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 of a dense weight: ``(w8 float8_e4m3fn [out, in], scale float8_e8m0fnu [ceil(out/b), ceil(in/b)])``.

    Each ``block x block`` tile gets the smallest power-of-two scale with ``amax / scale <= 448``.
    """
    _check_2d(w, "quantize_fp8_blocks")
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    tiles = _pad_to(w.to(torch.float32), nr * block, nc * block).view(nr, block, nc, block)
    amax = tiles.abs().amax(dim=(1, 3))
    exponent = _ceil_log2((amax / E4M3_MAX).clamp_min(2.0 ** -126))
    scale = _expand_scale(_e8m0_bytes(exponent), block, block, rows, cols)
    w8 = (w.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return w8, _e8m0_bytes(exponent)


def dequantize_fp8_grid(w8: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 weight times a scale grid of ``row_block x col_block`` tiles (E8M0, uint8 or floating scales)."""
    _check_2d(w8, "dequantize_fp8_grid")
    rows, cols = w8.shape
    return (w8.to(torch.float32) * _expand_scale(scale, row_block, col_block, rows, cols)).to(dtype)


def dequantize_fp8_blocks(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          block: int | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_blocks`; the square block size is inferred from the shapes when not
    given (or when the given one does not fit), see :func:`infer_square_block`."""
    _check_2d(w8, "dequantize_fp8_blocks")
    rows, cols = w8.shape
    b = infer_square_block((rows, cols), tuple(scale.shape), block)
    return dequantize_fp8_grid(w8, scale, b, b, dtype)


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 table rows with one power-of-two scale per row per 32 columns: ``(w8 [rows, d], scale [rows, ceil(d/32)])``."""
    _check_2d(w, "quantize_fp8_rows")
    rows, cols = w.shape
    nc = -(-cols // MX_BLOCK)
    groups = _pad_to(w.to(torch.float32), rows, nc * MX_BLOCK).view(rows, nc, MX_BLOCK)
    amax = groups.abs().amax(-1)
    exponent = _ceil_log2((amax / E4M3_MAX).clamp_min(2.0 ** -126))
    scale = _expand_scale(_e8m0_bytes(exponent), 1, MX_BLOCK, rows, cols)
    w8 = (w.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return w8, _e8m0_bytes(exponent)


def dequantize_fp8_rows(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_rows`."""
    return dequantize_fp8_grid(w8, scale, 1, MX_BLOCK, dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of an expert weight: ``(packed int8 [out, in/2], scale float8_e8m0fnu [out, ceil(in/32)])``.

    Low nibble = even column. Each 32-column group gets the smallest power-of-two scale with
    ``amax / scale <= 6``; values round to nearest E2M1, ties to even.
    """
    _check_2d(w, "quantize_mxfp4")
    rows, cols = w.shape
    if cols % 2:
        raise ValueError(f"quantize_mxfp4 needs an even number of columns, got {cols}")
    nc = -(-cols // MX_BLOCK)
    groups = _pad_to(w.to(torch.float32), rows, nc * MX_BLOCK).view(rows, nc, MX_BLOCK)
    exponent = _ceil_log2((groups.abs().amax(-1) / E2M1_MAX).clamp_min(2.0 ** -126))
    codes = e2m1_encode(groups / _pow2(exponent).unsqueeze(-1)).flatten(-2)[:, :cols]
    return pack_nibbles(codes).view(torch.int8), _e8m0_bytes(exponent)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: ``[out, 2 * packed_cols]`` in ``dtype``."""
    _check_2d(packed, "dequantize_mxfp4")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    block = infer_block(cols, scale.shape[1], MX_BLOCK)
    values = e2m1_decode(unpack_nibbles(packed))
    return (values * _expand_scale(scale, 1, block, rows, cols)).to(dtype)


def _fits(dim: int, n_scales: int, block: int) -> bool:
    return block >= 1 and -(-dim // block) == n_scales


_POW2_BLOCKS = tuple(2 ** k for k in range(21))


def infer_block(dim: int, n_scales: int, preferred: int | None = None) -> int:
    """Block length along a dim of ``dim`` values covered by ``n_scales`` scales (``ceil(dim/b) == n_scales``).

    Tries ``preferred``, then powers of two from 1 up; raises ValueError if none fits.
    """
    for b in ((preferred,) if preferred else ()) + _POW2_BLOCKS:
        if _fits(dim, n_scales, b):
            return b
    raise ValueError(f"{n_scales} scales cannot cover a dimension of {dim} in power-of-two blocks")


def infer_square_block(shape: tuple[int, int], scale_shape: tuple[int, int], preferred: int | None = None) -> int:
    """Square block ``b`` with ``scale_shape == (ceil(rows/b), ceil(cols/b))``: ``preferred`` first, then powers
    of two. Raises ValueError if none fits."""
    (rows, cols), (s_rows, s_cols) = shape, scale_shape
    for b in ((preferred,) if preferred else ()) + _POW2_BLOCKS:
        if _fits(rows, s_rows, b) and _fits(cols, s_cols, b):
            return b
    raise ValueError(f"a scale grid {list(scale_shape)} does not cover a weight {list(shape)} in square blocks")


__all__ = [
    "E4M3_MAX", "E2M1_MAX", "MX_BLOCK", "e8m0_to_float", "e2m1_encode", "e2m1_decode", "pack_nibbles",
    "unpack_nibbles", "e2m1_pair_table", "decode_e2m1_bytes", "decode_e4m3_bytes", "fake_quant_fp8", "fake_quant_fp4",
    "pack_fp4_e4m3", "unpack_fp4_e4m3", "pack_fp4_ue8m0",
    "unpack_fp4_ue8m0", "pack_fp8_ue8m0", "unpack_fp8_ue8m0", "quantize_fp8_blocks", "dequantize_fp8_blocks", "dequantize_fp8_grid",
    "quantize_fp8_rows", "dequantize_fp8_rows", "quantize_mxfp4", "dequantize_mxfp4", "infer_block",
    "infer_square_block",
]
