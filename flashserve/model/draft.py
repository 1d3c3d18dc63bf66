"""Draft heads: V4.1's DSpark stages (block drafting with a Markov head, docs/architecture.md#dspark) and V4's MTP block
(docs/architecture.md#v4-mtp). Reference forwards only; the engine's speculative decoding builds on these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..config.model_config import ModelConfig
from . import blas
from .block import Block
from .context import ForwardContext
from .mhc import HyperHead, collapse
from .norms import fp32, RMSNorm
from .quant import fake_quant_fp8
from .rope import apply_rope
from .state import DenseState


class MarkovHead(nn.Module):
    """Rank-r token-transition bias: ``head @ embed[prev]`` added to the drafted logits."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = blas.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    """σ(proj · [h ; markov embed]) — the drafter's estimate that a drafted token is accepted."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = blas.Linear(dim, 1, bias=False)


class DSparkStage(Block):
    """``mtp.s``: a window-only V4.1 block with its own (smaller) MoE; stage 0 owns the input projection,
    the last stage the draft norm, Markov head and confidence head."""

    def __init__(self, cfg: ModelConfig, stage: int):
        super().__init__(cfg, cfg.num_hidden_layers + stage, n_experts=cfg.dspark_n_routed_experts,
                         top_k=cfg.dspark_num_experts_per_tok)
        D = cfg.hidden_size
        if stage == 0:
            self.main_proj = blas.Linear(len(cfg.dspark_target_layer_ids) * D, D, bias=False)
            self.main_norm = RMSNorm(D, cfg.rms_norm_eps)
        if stage == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(D, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(D + cfg.dspark_markov_rank)


class _DraftWindow:
    """Keys for a drafting pass: the stage's context keys followed by the block rows' own keys, all visible."""

    def __init__(self, context: dict[int, torch.Tensor], ctx_pos: torch.Tensor, block_pos: torch.Tensor):
        self.context, self.ctx_pos, self.block_pos = context, ctx_pos, block_pos
        self.start = block_pos[:, 0]
        self.num_new = block_pos.shape[1]

    def begin(self, num_new: int, start: torch.Tensor | None = None) -> None:
        pass

    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.context[layer], kv], dim=1), torch.cat([self.ctx_pos, self.block_pos], dim=1)


@dataclass
class Draft:
    """One drafted block: tokens [B,k], their logits [B,k,V] and confidences [B,k]."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor


class DSparkStages(nn.ModuleList):
    """The 3 DSpark stages ``mtp.0..2`` (V4.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(DSparkStage(cfg, s) for s in range(cfg.num_nextn_predict_layers))
        self.cfg = cfg

    def draft(self, model: nn.Module, features: dict[int, torch.Tensor], positions: torch.Tensor,
              first_token: torch.Tensor, *, fake_quant: bool | None = None) -> Draft:
        """Greedy-draft ``dspark_block_size`` tokens after the context rows.

        ``features[L]`` [B,T,D]: mean stream entering target layer L at context positions ``positions``
        [B,T] (the last ≤ window positions are used); ``first_token`` [B] is the verified next token,
        placed at position ``positions[:, -1] + 1``.
        """
        W = self.cfg.sliding_window
        ctx_pos = positions[:, -W:]
        feats = torch.stack([features[L][:, -W:] for L in self.cfg.dspark_target_layer_ids], dim=2)
        keys = self.context_keys(model, feats, ctx_pos, fake_quant=fake_quant)
        return self.draft_block(model, keys, ctx_pos, ctx_pos[:, -1] + 1, first_token, fake_quant=fake_quant)

    def context_keys(self, model: nn.Module, feats: torch.Tensor, positions: torch.Tensor, *,
                     fake_quant: bool | None = None) -> torch.Tensor:
        """Every stage's window keys [B,T,stages,hd] for target positions ``positions`` [B,T] from their
        features ``feats`` [B,T,len(target layers),D] (docs/architecture.md#dspark, "context keys")."""
        fake_quant = model.fake_quant if fake_quant is None else fake_quant
        first = self[0]
        main_x = first.main_norm(first.main_proj(feats.flatten(-2).to(first.main_proj.weight.dtype)))
        cos, sin = model.rope.angles("main", positions)
        keys = []
        for stage in self:
            att = stage.attn
            kv = apply_rope(att.kv_norm(att.wkv(main_x)), cos, sin)
            keys.append(fake_quant_fp8(kv, block=32) if fake_quant else kv)
        return torch.stack(keys, dim=2)

    def block_states(self, model: nn.Module, keys: torch.Tensor, ctx_pos: torch.Tensor, block_start: torch.Tensor,
                     first_token: torch.Tensor, *, fake_quant: bool | None = None) -> torch.Tensor:
        """The collapsed states [B,k,D] of one block ``[first_token, N, ...]`` at positions ``block_start`` [B] +
        0..k-1 after the three stages, over context keys [B,T,stages,hd] at ``ctx_pos`` [B,T] (−1: no key)."""
        cfg = self.cfg
        fake_quant = model.fake_quant if fake_quant is None else fake_quant
        k = cfg.dspark_block_size
        B = first_token.shape[0]
        block_pos = block_start[:, None] + torch.arange(k, device=ctx_pos.device)
        tokens = torch.full((B, k), cfg.dspark_noise_token_id, dtype=torch.long, device=first_token.device)
        tokens[:, 0] = first_token
        context = {stage.layer: keys[:, :, s] for s, stage in enumerate(self)}
        ctx = ForwardContext(state=_DraftWindow(context, ctx_pos, block_pos), positions=block_pos, input_ids=tokens,
                             rope=model.rope, fake_quant=fake_quant, noncausal=True)
        x = model.embed_tokens(tokens)[..., None, :].expand(B, k, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = torch.zeros(B, k, cfg.hc_mult, device=x.device)
        pre[..., 0] = 1.0
        for stage in self:
            x, pre = stage(x, pre, ctx)
        return collapse(x, pre)

    def draft_block(self, model: nn.Module, keys: torch.Tensor, ctx_pos: torch.Tensor, block_start: torch.Tensor,
                    first_token: torch.Tensor, *, fake_quant: bool | None = None,
                    pick: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Draft:
        """Draft one block at positions ``block_start`` [B] + 0..k-1 over context keys [B,T,stages,hd] at
        ``ctx_pos`` [B,T] (−1: no key), ``first_token`` [B] leading the block. Each draft is ``pick(logits [B,V])``
        -> tokens [B], fed to the Markov head for the next one; by default the argmax (a greedy chain)."""
        k = self.cfg.dspark_block_size
        last = self[-1]
        h = self.block_states(model, keys, ctx_pos, block_start, first_token, fake_quant=fake_quant)
        base = fp32(model.head(last.norm(h)))
        markov = last.markov_head
        prev = first_token
        out_tokens, out_logits, conf = [], [], []
        for i in range(k):
            m = markov.embed(prev)
            logits = base[:, i] + fp32(markov.head(m))
            c = torch.sigmoid(last.confidence_head.proj(torch.cat([h[:, i], m.to(h.dtype)], dim=-1))).squeeze(-1)
            prev = logits.argmax(-1) if pick is None else pick(logits)
            out_tokens.append(prev)
            out_logits.append(logits)
            conf.append(fp32(c))
        return Draft(torch.stack(out_tokens, 1), torch.stack(out_logits, 1), torch.stack(conf, 1))


class MTPBlock(Block):
    """V4's ``mtp.s``: ``e_proj(enorm(embed(next))) + h_proj(hnorm(streams))`` → a V4 block → own hc_head."""

    def __init__(self, cfg: ModelConfig, stage: int):
        super().__init__(cfg, cfg.num_hidden_layers + stage)
        D = cfg.hidden_size
        self.e_proj = blas.Linear(D, D, bias=False)
        self.h_proj = blas.Linear(D, D, bias=False)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, D, cfg.hc_eps, cfg.rms_norm_eps)


class MTPBlocks(nn.ModuleList):
    """V4's MTP blocks ``mtp.0..``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(MTPBlock(cfg, s) for s in range(cfg.num_nextn_predict_layers))
        self.cfg = cfg

    def logits(self, model: nn.Module, streams: torch.Tensor, next_ids: torch.Tensor,
               state: DenseState | None = None, stage: int = 0, start: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for token t+2 (see :meth:`step`)."""
        return self.step(model, streams, next_ids, state, stage, start)[0]

    def step(self, model: nn.Module, streams: torch.Tensor, next_ids: torch.Tensor,
             state: DenseState | None = None, stage: int = 0,
             start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits for token t+2 from the final streams at t [B,S,n,D] and the token at t+1 [B,S].

        ``state`` is the MTP block's own window state (not the backbone's); rows continue it, or start at
        ``start`` [B] (the position of the streams' first row) on a fresh one."""
        blk = self[stage]
        B, S = next_ids.shape
        if state is None:
            state = DenseState(B, self.cfg.sliding_window, streams.device)
        state.begin(S, start)
        positions = state.start[:, None] + torch.arange(S, device=streams.device)
        ctx = ForwardContext(state=state, positions=positions, input_ids=next_ids, rope=model.rope,
                             fake_quant=model.fake_quant)
        e = blk.e_proj(blk.enorm(model.embed_tokens(next_ids)))
        x = blk.h_proj(blk.hnorm(streams)) + e[..., None, :]
        x, _ = blk(x, None, ctx)
        return model.head(blk.norm(blk.hc_head(x))), x  # the block's output streams chain the next step
