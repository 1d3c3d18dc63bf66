"""Interleaved (GPT-J) rotary embedding on the trailing dims of a vector, with YaRN
(docs/architecture.md#rope-and-yarn)."""

from __future__ import annotations

import math

import torch

from ..config.model_config import ModelConfig, RopeScaling


def rope_inv_freq(rope_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Angular frequency of each of the ``rope_dim / 2`` pairs; YaRN blends in ``1/factor`` without mscale."""
    base = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if scaling is None:
        return base.float()

    def correction_dim(beta: float) -> float:
        return rope_dim * math.log(scaling.original_max_position_embeddings / (2 * math.pi * beta)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return (base / scaling.factor * ramp + base * (1 - ramp)).float()


class RotaryTables(torch.nn.Module):
    """The two frequency sets of a model: ``main`` (window-only layers) and ``compress`` (layers with a
    compressed branch: θ = compress_rope_theta, plus YaRN when configured)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.rope_dim = cfg.qk_rope_head_dim
        self.register_buffer("main", torch.empty(self.rope_dim // 2), persistent=False)
        self.register_buffer("compress", torch.empty(self.rope_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the frequencies; needed after building on the meta device."""
        cfg = self.cfg
        with torch.no_grad():
            self.main = rope_inv_freq(self.rope_dim, cfg.rope_theta, None).to(self.main.device)
            self.compress = rope_inv_freq(self.rope_dim, cfg.compress_rope_theta, cfg.rope_scaling).to(
                self.compress.device)

    def angles(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``positions.shape + (rope_dim/2,)`` in fp32."""
        inv = self.main if kind == "main" else self.compress
        freqs = positions.to(torch.float32)[..., None] * inv
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` pairwise (channels 2i, 2i+1 form pair i).

    ``cos``/``sin`` broadcast against ``x[..., :rope/2]`` after the caller inserts head axes. ``inverse``
    rotates by the negative angle (used on the attention output, docs/architecture.md#attention).
    """
    rd = 2 * cos.shape[-1]
    if rd == 0:
        return x
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    pairs = rope.unflatten(-1, (rd // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
