"""Attention of every V4 / V4.1 layer: window KV, compressed KV, indexer selection, sink, grouped output.

Module and parameter names mirror the released checkpoint (``attn.wq_a``, ``attn.compressor.wkv``,
``attn.indexer.wq_b`` ...). One code path serves whole-sequence and cached forwards: keys always come
from the :class:`~flashserve.model.state.SequenceState` in the forward context.
"""

from __future__ import annotations


import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..config.model_config import ModelConfig
from . import blas, cpu_kernels
from .context import ForwardContext
from .norms import fp32, RMSNorm, rms
from .quant import fake_quant_fp4, fake_quant_fp8
from .rope import apply_rope
from .state import CacheKey

NEG_INF = float("-inf")
# Forwards of more query rows than this attend to the window in blocks of this many rows, each against
# only the keys its rows can see: prefill costs O(S·window) instead of O(S²).
WINDOW_BLOCK = 256


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard rotation of the last axis (a power of two), computed in place-free
    butterflies; V4's indexer rotates q and k with it before the FP4 simulation."""
    d = x.shape[-1]
    y = x
    h = 1
    while h < d:
        y = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return y * d ** -0.5


def v4_fake_quant_kv(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """V4 reference QAT point: FP8 with power-of-two scales per 64 on the non-RoPE dims (Appendix A)."""
    return torch.cat([fake_quant_fp8(x[..., :-rope_dim], block=64), x[..., -rope_dim:]], dim=-1)


def v4_fake_quant_index(x: torch.Tensor) -> torch.Tensor:
    """V4 reference indexer QAT point: Hadamard rotation then FP4 (UE8M0 scale per 32). The block size of
    the reference's FP4 simulation is not pinned by our sources; 32 follows V4.1's index rows."""
    d = x.shape[-1]
    if d & (d - 1):
        return x
    return fake_quant_fp4(hadamard(x), block=32, e4m3_scale=False)


@dataclass(frozen=True)
class QatPoints:
    """Where a family rounds attention's activations in QAT (docs/architecture.md#numerics-and-quantisation-points),
    each a function of the tensor: bound once from the config (:func:`qat_points`)."""

    window_kv: Callable[[torch.Tensor], torch.Tensor]  # a layer's window rows
    compressed_kv: Callable[[torch.Tensor], torch.Tensor]  # compressed main entries
    index_key: Callable[[torch.Tensor], torch.Tensor]  # index keys
    index_query: Callable[[torch.Tensor], torch.Tensor]  # the indexer's query


def qat_points(cfg: ModelConfig) -> QatPoints:
    """V4.1: FP8 window rows, FP4 compressed entries (E4M3 scales per 16) and index rows (UE8M0 per 32); V4: the
    reference's FP8 on the non-RoPE dims and a rotated FP4 index."""
    if cfg.is_v41:
        index = functools.partial(fake_quant_fp4, block=32, e4m3_scale=False)
        return QatPoints(window_kv=functools.partial(fake_quant_fp8, block=32),
                         compressed_kv=functools.partial(fake_quant_fp4, block=16, e4m3_scale=True),
                         index_key=index, index_query=index)
    kv = functools.partial(v4_fake_quant_kv, rope_dim=cfg.qk_rope_head_dim)
    return QatPoints(window_kv=kv, compressed_kv=kv, index_key=v4_fake_quant_index, index_query=v4_fake_quant_index)


def _gather_groups(raw: torch.Tensor, last: torch.Tensor, first_pos: torch.Tensor, n_groups: int,
                   ratio: int, held_from: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``n_groups`` position-aligned groups starting at ``first_pos`` [B] (a multiple of ratio)
    from a right-aligned raw buffer whose last row is position ``last`` [B]: ([B,G,ratio,c], present).
    ``held_from`` [B]: rows before this position are in the buffer but hold nothing (fixed-shape reads)."""
    g = torch.arange(n_groups, device=raw.device)
    r = torch.arange(ratio, device=raw.device)
    pos = first_pos[:, None, None] + g[None, :, None] * ratio + r[None, None, :]  # [B,G,ratio]
    idx = raw.shape[1] - 1 - (last[:, None, None] - pos)
    present = (idx >= 0) & (pos >= 0) & (pos <= last[:, None, None])
    if held_from is not None:
        present = present & (pos >= held_from[:, None, None])
    idx = idx.clamp(0, max(raw.shape[1] - 1, 0))
    rows = torch.gather(raw, 1, idx.flatten(1)[..., None].expand(-1, -1, raw.shape[-1]))
    return rows.view(*pos.shape, raw.shape[-1]), present


class Compressor(nn.Module):
    """Pools raw rows into one compressed entry per ``ratio`` tokens, aligned to absolute positions.

    V4.1 (``overlap=False``, no ``ape``): entry j = RMS(Σ softmax_t(z_t) ⊙ c_t over tokens 2j, 2j+1); ratio 1
    has no gate. V4 CSA (``overlap=True``): entry w pools group w−1's first half-channels with group w's
    second half over 2·ratio slots, gates biased by ``ape``; V4 HCA: one group with ``ape``.
    """

    def __init__(self, dim_in: int, dim: int, ratio: int, *, overlap: bool, ape: bool, gate: bool, eps: float):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        self.wkv = blas.Linear(dim_in, width, bias=False)
        self.wgate = blas.Linear(dim_in, width, bias=False) if gate else None
        self.ape = nn.Parameter(torch.zeros(ratio, width)) if ape else None
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, key: CacheKey,
                products: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """New entries [B,G,dim] (pre-RoPE latents, fp32) and how many are real per row [B]. ``products``: ``x``
        times ``wkv`` and ``wgate`` made already (by a joint product: ``"wkv"``, ``"wgate"``)."""
        state, ratio = ctx.state, self.ratio
        xf = fp32(x)  # compressor weights are applied in fp32 (docs/architecture.md#compressor)
        products = products or {}
        c = products.get("wkv")
        if c is None:
            c = blas.linear(xf, fp32(self.wkv.weight), blas.panels(self.wkv, "weight"))
        if self.wgate is not None:
            g = products.get("wgate")
            if g is None:
                g = blas.linear(xf, fp32(self.wgate.weight), blas.panels(self.wgate, "weight"))
        raw = c if self.wgate is None else torch.cat([c, g], dim=-1)
        start = ctx.positions[:, 0]
        end = ctx.positions[:, -1] + 1
        first_group = start // ratio  # groups before this one were emitted by earlier forwards
        n_new = end // ratio - first_group
        keep_from = (end // ratio - (1 if self.overlap else 0)).clamp(min=0) * ratio
        full = state.compressor_raw(key, raw, keep_from)
        if state.fixed_shape:  # the most groups S rows can complete; no host sync
            G = -(-x.shape[1] // ratio)
        else:
            G = int(n_new.max()) if n_new.numel() else 0
        if G == 0:
            return c.new_zeros(c.shape[0], 0, self.dim), n_new
        last = end - 1
        held = state.raw_held_from(key)
        rows, present = _gather_groups(full, last, first_group * ratio, G, ratio, held)
        width = c.shape[-1]
        kv, gate = rows[..., :width], (rows[..., width:] if self.wgate is not None else None)
        if gate is None:  # ratio 1: the latent is the row itself
            pooled = kv[:, :, 0]
        else:
            if self.ape is not None:
                gate = gate + fp32(self.ape)
            gate = gate.masked_fill(~present[..., None], NEG_INF)
            if self.overlap:
                prev, prev_present = _gather_groups(full, last, (first_group - 1) * ratio, G, ratio, held)
                d = self.dim
                prev_gate = prev[..., width:][..., :d]
                if self.ape is not None:
                    prev_gate = prev_gate + fp32(self.ape)[:, :d]
                prev_gate = prev_gate.masked_fill(~prev_present[..., None], NEG_INF)
                kv = torch.cat([prev[..., :width][..., :d], kv[..., d:]], dim=2)
                gate = torch.cat([prev_gate, gate[..., d:]], dim=2)
            weights = torch.softmax(gate, dim=2).nan_to_num(0.0)
            pooled = (weights * kv).sum(dim=2)
        return self.norm(pooled), n_new


class Indexer(nn.Module):
    """Lightning indexer: ``I[t,j] = Σ_h w[t,h] · relu(q[t,h] · K_j) / sqrt(d)``; selects top-k entries.

    V4.1 index keys come from the main latent (``wk`` + ``k_norm``, on KV sources only); V4 runs its own
    overlapping compressor at ``index_head_dim``. Query side (``wq_b``, ``weights_proj``) on index sources.
    """

    def __init__(self, cfg: ModelConfig, ratio: int, *, keys: bool, queries: bool):
        super().__init__()
        D, ihd, nih = cfg.hidden_size, cfg.index_head_dim, cfg.index_n_heads
        self.n_heads, self.head_dim, self.topk = nih, ihd, cfg.index_topk
        if cfg.is_v41:
            if keys:
                self.wk = blas.Linear(cfg.head_dim, ihd, bias=False)
                self.k_norm = RMSNorm(ihd, cfg.rms_norm_eps)
        elif keys:
            self.compressor = Compressor(D, ihd, ratio, overlap=True, ape=True, gate=True, eps=cfg.rms_norm_eps)
        if queries:
            self.wq_b = blas.Linear(cfg.q_lora_rank, nih * ihd, bias=False)
            self.weights_proj = blas.Linear(D, nih, bias=False)

    def query(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext, rounding: Callable | None,
              products: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The index query [B,S,H,d] (roped, then ``rounding`` as the keys were, if given: QAT) and head weights
        [B,S,H] (times H^-1/2). ``products``: ``qr`` times ``wq_b`` and ``x`` times ``weights_proj`` made already
        (by their names)."""
        B, S, _ = x.shape
        products = products or {}
        q = products.get("wq_b")
        q = (self.wq_b(qr) if q is None else q).view(B, S, self.n_heads, self.head_dim)
        cos, sin = ctx.angles("compress")
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])
        if rounding is not None:
            q = rounding(q)
        w = products.get("weights_proj")
        if w is None:
            w = blas.linear(fp32(x), fp32(self.weights_proj.weight), blas.panels(self.weights_proj, "weight"))
        return fp32(q), w * self.n_heads ** -0.5

    def scores(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext,
               rounding: Callable | None, products: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Index scores [B,S,T] (fp32, unmasked) of this forward's rows against all index keys [B,T,d].
        ``rounding``, ``products``: as in :meth:`query`."""
        q, w = self.query(x, qr, ctx, rounding, products)
        # the keys span the whole index cache, T entries growing with the context: each operand unpacked (and the
        # query FP4-rounded) and stored once. Fused at one row, inductor redid the page lookups, the FP4 unpacking
        # and the query's rounding for every head, entry and column, and stored all [H, T, d] products before
        # summing them: tiny-v41's compiled step took 179 ms at 32K context against 7.8 ms at 1K
        q, keys = blas.stored_operand(q), blas.stored_operand(fp32(keys))
        s = blas.einsum("bshd,btd->bsht", q, keys).relu() * self.head_dim ** -0.5
        return blas.einsum("bsht,bsh->bst", s, w)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k entries among visible ones: (indices [B,S,k'], valid [B,S,k']) with k' = min(k, T)."""
    values, indices = top_k(scores.masked_fill(~visible, NEG_INF), k)
    return indices, torch.isfinite(values)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest along the last axis, ties going to the lower index, in ascending index order.

    ``torch.topk`` breaks ties in no set order, and its choice changes with the axis length, so a chunk
    boundary or a batch neighbour could change which of two equal-scored entries is read (FP4 index scores
    tie often). Here the k-th largest value ``v`` decides: every entry above ``v``, then the first entries
    equal to ``v`` until there are k. No sort and no host sync: compares, a cumulative sum and a scatter.
    """
    T = x.shape[-1]
    k = min(k, T)
    if k == 0:
        return x[..., :0], torch.zeros(x.shape[:-1] + (0,), dtype=torch.long, device=x.device)
    v = x.topk(k, dim=-1).values[..., -1:]  # the k-th largest value per row
    above = x > v
    at = x == v
    need = k - above.sum(-1, keepdim=True)  # how many entries equal to v to take
    chosen = above | (at & (at.cumsum(-1) <= need))
    slot = torch.where(chosen, chosen.cumsum(-1) - 1, k)  # its place among the chosen, or the spill slot k
    ar = torch.arange(T, device=x.device).expand_as(slot)
    indices = torch.zeros(x.shape[:-1] + (k + 1,), dtype=torch.long, device=x.device).scatter_(-1, slot, ar)
    indices = indices[..., :k]
    return x.gather(-1, indices), indices


def candidate_pool(scores: torch.Tensor, visible: torch.Tensor, n_visible: torch.Tensor, block: int,
                   n_blocks: int) -> torch.Tensor:
    """V4.1 candidate mask [B,S,T]: the ``n_blocks`` best blocks of ``block`` entries by max score, with the
    block of the newest visible entry always kept (docs/architecture.md#indexer-and-candidate-pool)."""
    B, S, T = scores.shape
    nb = -(-T // block)
    masked = scores.masked_fill(~visible, NEG_INF)
    padded = torch.nn.functional.pad(masked, (0, nb * block - T), value=NEG_INF)
    block_scores = padded.view(B, S, nb, block).amax(-1)
    newest = ((n_visible - 1).clamp(min=0) // block).clamp(max=nb - 1)  # [B,S]
    has_any = n_visible > 0
    pin = torch.where(has_any, float("inf"), NEG_INF).to(block_scores.dtype)
    block_scores = block_scores.scatter(-1, newest[..., None], pin[..., None])
    keep_values, keep_indices = top_k(block_scores, min(n_blocks, nb))
    chosen = torch.zeros(B, S, nb, dtype=torch.bool, device=scores.device)
    chosen.scatter_(-1, keep_indices, keep_values > NEG_INF)
    return chosen.repeat_interleave(block, dim=-1)[..., :T]


def _made(products: dict[str, torch.Tensor], path: str, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` times ``layer``'s weight: its joint product when ``products`` has it (by ``path``), else the layer's."""
    y = products.get(path)
    return layer(x) if y is None else y


def _under(products: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The joint products of the weights under ``prefix`` (``"compressor."``), by their module's name there."""
    return {p[len(prefix):].removesuffix(".weight"): y for p, y in products.items() if p.startswith(prefix)}


class Attention(nn.Module):
    """One layer's attention (docs/architecture.md#attention): MQA with K = V = a 512-wide latent, sink, inverse
    RoPE."""

    def __init__(self, cfg: ModelConfig, layer: int, *, ratio: int = 0, role: str = "swa"):
        """``layer``: backbone index, or ``num_hidden_layers + s`` for MTP / DSpark stage ``s`` (its state key)."""
        super().__init__()
        D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.cfg, self.layer, self.ratio, self.role = cfg, layer, ratio, role
        self.n_heads, self.head_dim, self.window = H, hd, cfg.sliding_window
        self.o_groups = cfg.o_groups  # heads and output groups of this rank (tensor parallel: a slice of each)
        self.qat = qat_points(cfg)
        self.query_head_norm = cfg.query_head_norm
        self.rope_kind = "compress" if ratio > 0 else "main"
        self.wq_a = blas.Linear(D, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = blas.Linear(cfg.q_lora_rank, H * hd, bias=False)
        self.wkv = blas.Linear(D, hd, bias=False)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = blas.Linear(H * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = blas.Linear(cfg.o_groups * cfg.o_lora_rank, D, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        # the global caches this layer writes (a KV source) and reads (its source's)
        self.main_key, self.index_key = CacheKey(layer), CacheKey(layer, index=True)
        src = cfg.kv_source(layer) if ratio > 0 else None
        self.src_main = CacheKey(src) if src is not None else None
        self.src_index = CacheKey(src, index=True) if src is not None else None
        eps = cfg.rms_norm_eps
        if ratio == 0:
            return
        if cfg.is_v41:
            if role == "full":
                self.compressor = Compressor(D, hd, ratio, overlap=False, ape=False, gate=ratio > 1, eps=eps)
            if role in ("full", "reindex"):
                self.indexer = Indexer(cfg, ratio, keys=role == "full", queries=True)
        else:
            csa = role == "csa"
            self.compressor = Compressor(D, hd, ratio, overlap=csa, ape=True, gate=True, eps=eps)
            if csa:
                self.indexer = Indexer(cfg, ratio, keys=True, queries=True)

    def joint_row_weights(self) -> dict[str, tuple[str, ...]]:
        """The weights this layer multiplies the same input by, per input (``"x"``: the layer's rows, ``"qr"``:
        the query latent): one product each in a compiled step of several rows (blas.joint_products)."""
        x, qr = ["wq_a.weight", "wkv.weight"], ["wq_b.weight"]
        if self.compressor is not None and self.src_main == self.main_key:  # produce() runs the compressors
            x += [f"compressor.{w}.weight" for w in ("wkv", "wgate") if getattr(self.compressor, w) is not None]
            if self.role == "csa":  # V4: the indexer's own compressor
                x += ["indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight"]
        if self.ratio > 0 and self.indexer is not None and self.cfg.index_source(self.layer) == self.layer:
            x.append("indexer.weights_proj.weight")  # _select() scores
            qr.append("indexer.wq_b.weight")
        return {"x": tuple(x), "qr": tuple(qr)}

    # -------------------------------------------------------------- compressed-cache production
    def produce(self, x: torch.Tensor, ctx: ForwardContext, products: dict[str, torch.Tensor] | None = None) -> None:
        """Run this KV source's compressor(s) on rows ``x`` and append to the global caches
        (docs/architecture.md#compressor);
        ``products``: ``x``'s joint products by path (:meth:`joint_row_weights`)."""
        if self.compressor is None or self.layer in ctx.produced:
            return
        products = products or {}
        latent, n_new = self.compressor(x, ctx, self.main_key, _under(products, "compressor."))
        G = latent.shape[1]
        first = ctx.positions[:, 0] // self.ratio
        pos = (first[:, None] + torch.arange(G, device=x.device)) * self.ratio  # [B,G]
        cos, sin = ctx.rope.angles("compress", pos)
        main = apply_rope(latent, cos, sin)
        if self.role == "full":  # V4.1's KV source: index keys projected from the compressed latent
            wk = self.indexer.wk
            index = self.indexer.k_norm(blas.linear(fp32(latent), fp32(wk.weight), blas.panels(wk, "weight")))
            index = apply_rope(index, cos, sin)
            if ctx.fake_quant:
                index = self.qat.index_key(index)
            ctx.state.append_compressed(self.index_key, index.to(x.dtype), n_new)
        elif self.indexer is not None:  # V4's CSA layer: the indexer's own compressor
            ilatent, n_idx = self.indexer.compressor(x, ctx, self.index_key, _under(products, "indexer.compressor."))
            ipos = (first[:, None] + torch.arange(ilatent.shape[1], device=x.device)) * self.ratio
            icos, isin = ctx.rope.angles("compress", ipos)
            index = apply_rope(ilatent, icos, isin)
            if ctx.fake_quant:
                index = self.qat.index_key(index)
            ctx.state.append_compressed(self.index_key, index.to(x.dtype), n_idx)
        if ctx.fake_quant:
            main = self.qat.compressed_kv(main)
        ctx.state.append_compressed(self.main_key, main.to(x.dtype), n_new)
        ctx.produced.add(self.layer)

    def _select(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext, t: torch.Tensor,
                products: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this layer's indexer (an index source) and publish its top-k for the layers that reuse it;
        ``products``: the joint products of ``x`` and ``qr`` by path (:meth:`joint_row_weights`)."""
        paged = None
        if x.device.type == "cpu" and x.dtype != torch.float64 and cpu_kernels.index_topk_available():
            paged = ctx.state.index_pages(self.src_index)
        if paged is not None:
            return self._select_paged(x, qr, ctx, t, products, *paged)
        keys, n_entries = ctx.state.compressed(self.src_index)
        visible = self._visible(t, keys.shape[1], n_entries)
        rounding = self.qat.index_query if ctx.fake_quant else None
        scores = self.indexer.scores(x, qr, keys, ctx, rounding, _under(products, "indexer."))
        cfg = self.cfg
        if cfg.candidate_source_layer_id >= 0:  # V4.1's candidate pool
            if self.layer == cfg.candidate_source_layer_id:
                n_vis = visible.sum(-1)
                ctx.candidates = candidate_pool(scores, visible, n_vis, cfg.candidate_block_size,
                                                cfg.candidate_topk_blocks)
            elif self.layer > cfg.candidate_source_layer_id and ctx.candidates is not None:
                visible = visible & ctx.candidates[..., :visible.shape[-1]]
        sel = select_topk(scores, visible, cfg.index_topk)
        ctx.topk[self.layer] = sel
        return sel

    def _select_paged(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext, t: torch.Tensor,
                      products: dict[str, torch.Tensor], pages: torch.Tensor, table: torch.Tensor,
                      n_entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_select` where the index keys are FP4 records in CPU pages: one kernel scores them as stored and
        keeps the top-k (and the candidate pool) as it goes (``cpu_kernels.index_topk``, tested equal to
        :meth:`Indexer.scores`, :func:`candidate_pool` and :func:`select_topk`). The torch code read and unpacked
        the whole cache, stored its scores and took ten passes over them: at 32K context on tiny-v41 its compiled
        step took 9.9 ms against 1.6 at 1K (docs/engine-speed.md#the-c-kernels)."""
        cfg = self.cfg
        B, S = t.shape
        rounding = self.qat.index_query if ctx.fake_quant else None
        q, w = self.indexer.query(x, qr, ctx, rounding, _under(products, "indexer."))
        limit = torch.minimum((t + 1) // self.ratio, n_entries[:, None])  # [B,S] visible entries
        cand, n_blocks = t.new_zeros(B * S, 0), 0
        if cfg.candidate_source_layer_id >= 0:  # V4.1's candidate pool
            if self.layer == cfg.candidate_source_layer_id:
                n_blocks = cfg.candidate_topk_blocks
            elif self.layer > cfg.candidate_source_layer_id and ctx.candidate_blocks is not None:
                cand = ctx.candidate_blocks
        k = min(cfg.index_topk, table.shape[1] * pages.shape[1])
        idx, valid, pool = cpu_kernels.index_topk(q.flatten(0, 1).float(), w.flatten(0, 1).float(), pages, table,
                                                  limit.flatten(), cand, k, cfg.candidate_block_size, n_blocks)
        if n_blocks:
            ctx.candidate_blocks = pool  # [B*S, n_blocks] block ids, ascending, -1 past the end
        sel = idx.view(B, S, k), valid.view(B, S, k)
        ctx.topk[self.layer] = sel
        return sel

    def _visible(self, t: torch.Tensor, T: int, n_entries: torch.Tensor) -> torch.Tensor:
        """[B,S,T]: entry j is complete before query position t (j < (t+1)/ratio) and present (j < n)."""
        j = torch.arange(T, device=t.device)
        return (j[None, None, :] < ((t + 1) // self.ratio)[..., None]) & (j[None, None, :] < n_entries[:, None, None])

    def _window_ok(self, t: torch.Tensor, kpos: torch.Tensor, noncausal: bool) -> torch.Tensor:
        """[B,s,T]: query row at position ``t`` [B,s] may see window key ``j`` at ``kpos`` [B,T] (−1: empty)."""
        kp = kpos[:, None, :]
        return (kp >= 0) if noncausal else (kp >= 0) & (kp <= t[..., None]) & (kp > t[..., None] - self.window)

    def _attend(self, q: torch.Tensor, t: torch.Tensor, keys: torch.Tensor, kpos: torch.Tensor,
                comp: tuple[torch.Tensor, torch.Tensor] | None, noncausal: bool) -> torch.Tensor:
        """One softmax over window keys, compressed entries and the sink for query rows ``q`` [B,s,H,hd]
        at positions ``t`` [B,s]; window ``keys`` [B,T,hd] (shared K = V) at ``kpos`` [B,T] (−1: empty);
        ``comp``: the compressed entries (their own values) [B,s',E,hd] (s' 1: the same for every row, or s:
        each row's picks) and which each row may see [B,s,E]."""
        B, s, H, hd = q.shape
        win_ok = self._window_ok(t, kpos, noncausal)
        sink = fp32(self.attn_sink)
        if (q.device.type == "cpu" and q.dtype == torch.float32 and s <= cpu_kernels.ATTEND_ROWS_MAX
                and H * hd >= cpu_kernels.ATTEND_ROWS_MIN_WIDTH and cpu_kernels.attend_rows_preferred()):
            # only the keys and entries each row may see are read (a decode step's fixed shapes hold them all)
            ent, ent_ok = comp if comp is not None else (q.new_zeros(B, 1, 0, hd), win_ok.new_zeros(B, s, 0))
            return cpu_kernels.attend_rows(q, fp32(keys), win_ok.expand(B, s, -1), fp32(ent),
                                           ent_ok.expand(B, s, -1), sink, hd ** -0.5)
        kf = blas.shared_operand(fp32(keys), B * s)
        window_scores = blas.einsum("bshd,btd->bhst", q, kf) * hd ** -0.5
        logits = [window_scores.masked_fill(~win_ok[:, None], NEG_INF)]
        if comp is not None:
            ent, ent_ok = comp
            dense = ent.shape[1] == 1
            ent = blas.shared_operand(fp32(ent[:, 0] if dense else ent), B * s)
            pattern = "bshd,btd->bhst" if dense else "bshd,bskd->bhsk"
            logits.append((blas.einsum(pattern, q, ent) * hd ** -0.5).masked_fill(~ent_ok[:, None], NEG_INF))
        sink = sink.view(1, H, 1, 1).expand(B, H, s, 1)
        probs = torch.softmax(torch.cat(logits + [sink], dim=-1), dim=-1)[..., :-1]
        tw = keys.shape[1]
        out = blas.einsum("bhst,btd->bshd", probs[..., :tw], kf)
        if comp is not None:
            out = out + blas.einsum("bhst,btd->bshd" if dense else "bhsk,bskd->bshd", probs[..., tw:], ent)
        return out

    # -------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, S, _ = x.shape
        H, hd = self.n_heads, self.head_dim
        cos, sin = ctx.angles(self.rope_kind)
        xw = blas.joint_products(x, self, "x")  # x's products in one call (compiled steps of several rows)
        qr = self.q_norm(_made(xw, "wq_a.weight", self.wq_a, x))
        qw = blas.joint_products(qr, self, "qr")
        q = _made(qw, "wq_b.weight", self.wq_b, qr).view(B, S, H, hd)
        made = {**xw, **qw}
        if self.query_head_norm:
            q = rms(q, self.cfg.rms_norm_eps)
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])
        kv = apply_rope(self.kv_norm(_made(xw, "wkv.weight", self.wkv, x)), cos, sin)
        if ctx.fake_quant:
            kv = self.qat.window_kv(kv)
        keys, kpos = ctx.state.window(self.layer, kv)
        t = ctx.positions
        qf = blas.shared_operand(fp32(q), B * S)
        comp = None  # compressed entries [B,1 or S,E,hd] and which each row may see [B,S,E]
        if self.ratio > 0:
            if self.src_main == self.main_key:
                self.produce(x, ctx, made)
            idx_src = self.cfg.index_source(self.layer)
            if idx_src is None:  # V4 HCA: attend to every visible entry
                entries, n_entries = ctx.state.compressed(self.src_main)
                comp = (entries[:, None], self._visible(t, entries.shape[1], n_entries))
            else:
                if idx_src == self.layer:
                    idx, valid = self._select(x, qr, ctx, t, made)
                else:
                    idx, valid = ctx.topk[idx_src]
                comp = (ctx.state.compressed_rows(self.src_main, idx), valid)  # [B,S,k,hd]: only the rows picked
        block = max(WINDOW_BLOCK, self.window)
        if ctx.noncausal or S <= block:
            out = self._attend(qf, t, keys, kpos, comp, ctx.noncausal)
        else:  # long chunks: each block of query rows reads only the window keys it can see
            T, outs = keys.shape[1], []
            for a in range(0, S, block):
                b = min(a + block, S)
                lo, hi = max(0, T - S + a - self.window + 1), T - S + b  # new row i is key T - S + i
                part = None if comp is None else (comp[0] if comp[0].shape[1] == 1 else comp[0][:, a:b],
                                                  comp[1][:, a:b])
                outs.append(self._attend(qf[:, a:b], t[:, a:b], keys[:, lo:hi], kpos[:, lo:hi], part, False))
            out = torch.cat(outs, dim=1)
        out = apply_rope(out, cos[:, :, None], sin[:, :, None], inverse=True).to(x.dtype)
        u = self.wo_a.grouped(out.reshape(B, S, self.o_groups, -1))  # [B, S, G, o_lora_rank]
        return self.wo_b(u.flatten(2))
