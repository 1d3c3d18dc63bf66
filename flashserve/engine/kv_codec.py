"""How the engine's cache stores its rows (docs/architecture.md#kv-cache): float values in the compute dtype, or the
packed records of
:func:`flashserve.config.arithmetic.kv_record` (V4.1: FP4-E4M3 main rows, FP4-UE8M0 index rows, FP8-UE8M0
window rows; V4: FP8 rows with bf16 RoPE dims and FP4 index rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config.arithmetic import kv_record
from ..config.model_config import ModelConfig
from ..model import modes, quant
from ..model.modes import COMPILED

E4M3_MAX = 448.0
# --------------------------------------------------------------------------- packed records
def _pack_v4_fp8(x: torch.Tensor, rope: int, width: int) -> torch.Tensor:
    """V4 record: FP8-E4M3 no-RoPE dims with one UE8M0 scale per 64, bf16 RoPE dims, zero pad to ``width``."""
    nope = x[..., : x.shape[-1] - rope].float()
    d = nope.shape[-1]
    nb = -(-d // 64)
    padded = torch.nn.functional.pad(nope, (0, nb * 64 - d)).unflatten(-1, (nb, 64))
    amax = padded.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    exp = torch.ceil(torch.log2(amax / E4M3_MAX))
    q = (padded / torch.exp2(exp)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.flatten(-2)[..., :d].view(torch.uint8)
    r = x[..., x.shape[-1] - rope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    sc = (exp.squeeze(-1) + 127).to(torch.uint8)
    out = torch.cat([q, r, sc], dim=-1)
    return torch.nn.functional.pad(out, (0, width - out.shape[-1]))


def _unpack_v4_fp8(p: torch.Tensor, dim: int, rope: int, dtype: torch.dtype) -> torch.Tensor:
    d = dim - rope
    nb = -(-d // 64)
    q = quant.decode_e4m3_bytes(p[..., :d])
    r = p[..., d:d + 2 * rope].contiguous().view(torch.bfloat16).float()
    exp = p[..., d + 2 * rope:d + 2 * rope + nb].float() - 127
    scale = torch.exp2(exp).repeat_interleave(64, dim=-1)[..., :d]
    return torch.cat([q * scale, r], dim=-1).to(dtype)


def _unpack_fp4(p: torch.Tensor, block: int, e4m3: bool, dtype: torch.dtype, pairs: torch.Tensor) -> torch.Tensor:
    """Table-driven inverse of ``pack_fp4_e4m3`` (``e4m3``) / ``pack_fp4_ue8m0``: same values, fewer ops.
    ``pairs``: :func:`quant.e2m1_pair_table` on ``p``'s device."""
    d = p.shape[-1] * 2 * block // (block + 2)  # record = d/2 code bytes + d/block scale bytes
    codes = p[..., : d // 2]
    vals = _e2m1_values(codes, pairs)  # [..., d]
    sc = p[..., d // 2:]
    scale = quant.decode_e4m3_bytes(sc) if e4m3 else quant.e8m0_to_float(sc)
    return (vals.unflatten(-1, (-1, block)) * scale[..., None]).flatten(-2).to(dtype)


@modes.per_mode
def _e2m1_values(codes: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The E2M1 values of code bytes ``codes``: eager on the CPU by quant's own table (faster), by ``pairs``
    elsewhere and in compiled steps."""
    if codes.device.type == "cpu":
        return quant.decode_e2m1_bytes(codes)
    return pairs[codes.long()].flatten(-2)


@_e2m1_values.variant(COMPILED)
def _e2m1_values_compiled(codes: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    return pairs[codes.long()].flatten(-2)


def _unpack_fp8(p: torch.Tensor, dtype: torch.dtype, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp8_ue8m0`` (E4M3 bytes + one UE8M0 scale per 32); ``scales``: the 256 UE8M0 values
    on ``p``'s device."""
    d = p.shape[-1] * 32 // 33
    q = quant.decode_e4m3_bytes(p[..., :d])
    return (q.unflatten(-1, (-1, 32)) * scales[p[..., d:].long()][..., None]).flatten(-2).to(dtype)


@dataclass
class Codec:
    """How one kind of row is stored: ``width`` bytes (packed) or values (float)."""

    width: int
    pack: Callable[[torch.Tensor], torch.Tensor] | None  # None = float storage
    unpack: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None


def codecs(cfg: ModelConfig, packed: bool, device: torch.device | str = "cpu") -> dict[str, Codec]:
    """Codecs of the ``main``, ``index`` and ``window`` rows; their decode tables live on ``device``, made
    once here (no table is created or looked up while a step runs)."""
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    if not packed:
        return {"main": Codec(hd, None, None), "index": Codec(ihd, None, None), "window": Codec(hd, None, None)}
    rec = kv_record(cfg)
    pairs = quant.e2m1_pair_table().to(device)
    scales = quant.e8m0_to_float(torch.arange(256, dtype=torch.uint8)).to(device)
    index = Codec(rec.index, quant.pack_fp4_ue8m0, lambda p, dt: _unpack_fp4(p, 32, False, dt, pairs))
    if cfg.is_v41:
        return {"main": Codec(rec.main, quant.pack_fp4_e4m3, lambda p, dt: _unpack_fp4(p, 16, True, dt, pairs)),
                "index": index,
                "window": Codec(rec.window, quant.pack_fp8_ue8m0, lambda p, dt: _unpack_fp8(p, dt, scales))}
    rope = cfg.qk_rope_head_dim
    v4 = Codec(rec.main, lambda x: _pack_v4_fp8(x, rope, rec.main),
               lambda p, dt: _unpack_v4_fp8(p, hd, rope, dt))
    return {"main": v4, "index": index, "window": v4}
