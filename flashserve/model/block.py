"""One transformer block with hyper-connections: V4 (each site collapses with its own ``pre``) and V4.1
(single-pass shifted mHC: a site's ``pre`` collapses the next site's input), docs/architecture.md#mhc."""

from __future__ import annotations

import torch
from torch import nn

from ..config.model_config import ModelConfig
from . import blas
from .attention import Attention
from .context import ForwardContext
from .engram import Engram
from .mhc import HyperMix, collapse, expand, hyper_mix
from .moe import MoE
from .norms import RMSNorm


class Block(nn.Module):
    """``layers.N``: optional engram, attention and MoE sublayers joined by mHC sites ``hc_attn``/``hc_ffn``."""

    ROW_WEIGHTS = ("hc_attn_fn", "hc_ffn_fn")  # multiplied by blas.linear (panel copies: weight_layout)

    def __init__(self, cfg: ModelConfig, layer: int, *, ratio: int = 0, role: str = "swa",
                 n_experts: int | None = None, top_k: int | None = None, hash_routed: bool = False,
                 engram_rows: int | None = None):
        super().__init__()
        n, D = cfg.hc_mult, cfg.hidden_size
        self.cfg, self.layer, self.shifted = cfg, layer, cfg.shifted_collapse
        self.engram = Engram(cfg, engram_rows) if engram_rows else None
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, ratio=ratio, role=role)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, n_experts or cfg.n_routed_experts, top_k or cfg.num_experts_per_tok, hash_routed)
        mix = (2 + n) * n
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, n * D)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3)))

    def mix(self, x: torch.Tensor, site: str) -> HyperMix:
        cfg = self.cfg
        return hyper_mix(x, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                         getattr(self, f"hc_{site}_scale"), n=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters,
                         hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, fn_panels=blas.panels(self, f"hc_{site}_fn"))

    def forward(self, x: torch.Tensor, pre_in: torch.Tensor | None, ctx: ForwardContext,
                engram_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams [B,S,n,D] and the incoming ``pre`` (V4.1) → new streams and the ``pre`` for the next block."""
        if self.engram is not None:
            x = self.engram(x, engram_ids, ctx.image_mask)
        x, attn_pre = self.attend(x, pre_in, ctx)
        return self.feed_forward(x, attn_pre, ctx.input_ids, ctx.image_mask)

    def attend(self, x: torch.Tensor, pre_in: torch.Tensor | None,
               ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention half (after the engram): streams [B,S,n,D] → streams and the attention site's ``pre``
        [B,S,n]."""
        a = self.mix(x, "attn")
        h = collapse(x, pre_in if self.shifted else a.pre)
        return expand(self.attn(self.attn_norm(h), ctx), x, a), a.pre

    def feed_forward(self, x: torch.Tensor, attn_pre: torch.Tensor, ids: torch.Tensor,
                     image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE half: streams [B,S,n,D] → streams and the FFN site's ``pre`` (what the next block collapses with
        in V4.1); ``ids`` [B,S] route hash layers."""
        f = self.mix(x, "ffn")
        h = collapse(x, attn_pre if self.shifted else f.pre)
        return expand(self.ffn(self.ffn_norm(h), ids, image_mask), x, f), f.pre

    def produce(self, x: torch.Tensor, pre_in: torch.Tensor, ctx: ForwardContext) -> None:
        """V4.1 decoder's global-cache producer: collapse with the previous block's ``pre``, norm, compress."""
        self.attn.produce(self.attn_norm(collapse(x, pre_in)), ctx)
