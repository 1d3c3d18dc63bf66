"""DSpark drafter training (docs/architecture.md#dspark): the stages trained with the backbone frozen.

:func:`draft_logits` is :meth:`flashserve.model.draft.DSparkStages.draft` with the Markov head's previous
tokens given (teacher forcing) instead of taken from its own argmax; fed the draft's own greedy tokens it
computes exactly what ``draft`` computes (tests/test_train_recipe.py checks this). Training targets are the
frozen backbone's own next-token distributions at the block's positions (KL), and for the confidence head
whether the drafted argmax equals the backbone's argmax (BCE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.norms import fp32


def draft_logits(model, features: dict[int, torch.Tensor], positions: torch.Tensor, first_token: torch.Tensor,
                 prev_tokens: torch.Tensor, *, fake_quant: bool | None = None, detach_confidence: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [B,k,V], confidence logits [B,k] (before the sigmoid) and the block rows' collapsed states
    [B,k,D] of one DSpark block per row.

    ``features``/``positions``/``first_token`` as for ``DSparkStages.draft``; ``prev_tokens`` [B,k] the token
    the Markov head conditions on at each block row (``draft`` uses ``first_token`` then its own argmaxes).
    """
    stages = model.mtp
    W = stages.cfg.sliding_window
    ctx_pos = positions[:, -W:]
    feats = torch.stack([features[L][:, -W:] for L in stages.cfg.dspark_target_layer_ids], dim=2)
    keys = stages.context_keys(model, feats, ctx_pos, fake_quant=fake_quant)
    h = stages.block_states(model, keys, ctx_pos, ctx_pos[:, -1] + 1, first_token, fake_quant=fake_quant)
    last = stages[-1]
    base = fp32(model.head(last.norm(h)))
    m = last.markov_head.embed(prev_tokens)  # [B,k,r]
    logits = base + fp32(last.markov_head.head(m))
    hc, mc = (h.detach(), m.detach()) if detach_confidence else (h, m)  # the confidence loss trains proj only
    conf = last.confidence_head.proj(torch.cat([hc, mc.to(h.dtype)], dim=-1)).squeeze(-1)
    return logits, fp32(conf), h


def anchor_batch(features: dict[int, torch.Tensor], ids: torch.Tensor, anchors: torch.Tensor, window: int, k: int):
    """Rows for drafting at ``anchors`` [B,M] (last context position p, p >= window - 1, p + k + 1 < S):
    features of positions p-window+1..p, their positions, the first token ids[p+1] and teacher-forced
    previous tokens ids[p+1..p+k]. Returns (features, positions, first, prev, target_rows [B*M,k]) where
    target_rows index the flattened [B*S] rows whose backbone logits predict the block's tokens."""
    B, S = ids.shape
    offs = torch.arange(-window + 1, 1, device=ids.device)
    pos = anchors[..., None] + offs  # [B,M,W]
    b = torch.arange(B, device=ids.device)[:, None, None]
    feats = {L: f[b, pos].flatten(0, 1) for L, f in features.items()}
    rows = anchors[..., None] + 1 + torch.arange(k, device=ids.device)  # [B,M,k] positions p+1..p+k
    first = ids[b[..., 0], anchors + 1].flatten()
    prev = ids[b, rows].flatten(0, 1)
    target_rows = (b * S + rows).flatten(0, 1)
    return feats, pos.flatten(0, 1), first, prev, target_rows


def drafter_loss(model, features, ids, target_logits, anchors):
    """KL(backbone ‖ drafter) over the block rows plus the confidence head's BCE; returns (loss, stats)."""
    cfg = model.cfg
    feats, pos, first, prev, rows = anchor_batch(features, ids, anchors, cfg.sliding_window, cfg.dspark_block_size)
    logits, conf, _ = draft_logits(model, feats, pos, first, prev)
    tgt = target_logits.flatten(0, 1)[rows]  # [N,k,V]
    logp_t = F.log_softmax(tgt, -1)
    logp_d = F.log_softmax(logits, -1)
    kl = (logp_t.exp() * (logp_t - logp_d)).sum(-1).mean()
    hit = (logits.argmax(-1) == tgt.argmax(-1)).float()
    bce = F.binary_cross_entropy_with_logits(conf, hit)
    return kl + 0.1 * bce, {"kl": kl.item(), "bce": bce.item(), "top1": hit.mean().item(),
                            "top1_by_row": hit.mean(0).tolist()}


def mtp_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 MTP (docs/architecture.md#v4-mtp): the MTP block's logits [B,S-1,V] for token t+2 from the backbone's final
    streams at t and the token at t+1, and the frozen backbone's logits at t+1 (its own prediction of t+2), as
    targets."""
    with torch.no_grad():
        out = model(ids, return_streams=True)
    logits = model.mtp.logits(model, out.streams[:, :-1], ids[:, 1:])
    return fp32(logits), out.logits[:, 1:].float()


def mtp_loss(model, ids: torch.Tensor):
    """KL(backbone ‖ MTP) over every position; returns (loss, stats)."""
    logits, tgt = mtp_logits(model, ids)
    logp_t = F.log_softmax(tgt, -1)
    kl = (logp_t.exp() * (logp_t - F.log_softmax(logits, -1))).sum(-1).mean()
    hit = (logits.argmax(-1) == tgt.argmax(-1)).float().mean()
    return kl, {"kl": kl.item(), "top1": hit.item()}
