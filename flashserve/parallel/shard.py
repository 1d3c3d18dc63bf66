"""Shard a built :class:`~flashserve.model.transformer.Transformer` for one rank of a :class:`Layout`.

The model is built whole (a preset's seeded weights, or a checkpoint) and each rank keeps its slices:

* attention: ``wq_b`` rows and ``attn_sink`` of the rank's query heads, ``wo_a`` rows of its output groups
  (column / group parallel), ``wo_b`` columns of those groups (row parallel: one all-reduce per layer);
* the shared expert's intermediate width (w1/w3 rows, w2 columns), summed in the MoE's one all-reduce;
* routed experts: whole experts per rank with EP, else each expert's intermediate width (TP-MoE);
* embedding and LM head: a slice of the vocabulary (masked lookup + all-reduce; logits all-gathered);
* everything else (mHC, router, norms, compressors, indexer, ``wq_a``, ``wkv``, engram, drafters, vision)
  is left whole: replicated.

Modules are replaced by subclasses that hold the :class:`~.comm.Comm` they talk through (no global state);
parameter names are unchanged, shapes are the rank's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from ..model import blas
from ..model.moe import Experts, MoE, SharedExpert
from ..model.norms import fp32
from .comm import Comm
from ..config.ranks import Layout, split


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone(), requires_grad=False)


def _linear(weight: torch.Tensor, cls=blas.Linear, **kw) -> nn.Linear:
    """A bias-free linear layer holding ``weight`` [out, in]."""
    out_f, in_f = weight.shape
    lin = cls(in_f, out_f, bias=False, device="meta", dtype=weight.dtype, **kw)
    lin.weight = _param(weight)
    return lin


def _plain(module: nn.Module, cls: type, what: str) -> None:
    if type(module) is not cls:
        raise ConfigError(f"sharding: {what} is a {type(module).__name__}; only {cls.__name__} is split here")


def _check_block(start: int, end: int, block: int, what: str) -> None:
    if block > 1 and (start % block or end % block):
        raise ConfigError(f"sharding: the slice [{start}, {end}) of {what} does not fall on the packed format's "
                          f"{block}-wide scale blocks; use another tensor_parallel_size or --quantization float")


def slice_packed(p, lead: tuple[int, int] | None = None, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None, what: str = "a packed weight"):
    """A :class:`~flashserve.model.packed.PackedWeights` holding a slice of ``p``'s logical ``[..., out, in]``
    weights: experts ``lead``, output ``rows``, input ``cols`` (on the format's scale blocks), bytes copied as
    they are (no re-quantization)."""
    from ..model.packed import INT8_ROWS, FP8, MXFP4, PackedWeights

    fmt, shape = p.fmt, list(p.shape)
    q, sc = p.qweight, p.scale
    if lead is not None:
        q, sc = q[lead[0]:lead[1]], sc[lead[0]:lead[1]]
        shape[0] = lead[1] - lead[0]
    if rows is not None:
        r0, r1 = rows
        rb = fmt.row_block if fmt.name == FP8 else 1
        _check_block(r0, r1, rb, what)
        q = q[..., r0:r1, :]
        sc = sc[..., r0:r1] if fmt.name in INT8_ROWS else sc[..., r0 // rb:r1 // rb, :]
        shape[-2] = r1 - r0
    if cols is not None:
        c0, c1 = cols
        if fmt.name == FP8:
            _check_block(c0, c1, fmt.col_block, what)
            q, sc = q[..., c0:c1], sc[..., c0 // fmt.col_block:c1 // fmt.col_block]
        elif fmt.name == MXFP4:
            _check_block(c0, c1, fmt.col_block, what)
            q, sc = q[..., c0 // 2:c1 // 2], sc[..., c0 // fmt.col_block:c1 // fmt.col_block]
        else:  # int8: one scale per row, whatever its columns
            q = q[..., c0:c1]
        shape[-1] = c1 - c0
    new = PackedWeights.__new__(PackedWeights)
    nn.Module.__init__(new)
    new.fmt, new.shape = fmt, tuple(shape)
    new.register_buffer("qweight", q.clone())
    new.register_buffer("scale", sc.clone())
    if fmt.name == MXFP4:  # the computed E2M1 table a compiled step decodes with
        new.register_buffer("e2m1_bits", torch.empty(16, dtype=torch.int32, device=q.device), persistent=False)
        new.reset_buffers()
    return new


def slice_linear(mod: nn.Module, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
                 what: str = "a linear layer") -> nn.Module:
    """The same kind of bias-free linear layer (float or packed) over a slice of ``mod``'s weight."""
    from ..model.packed import PackedLinear

    if type(mod) in (nn.Linear, blas.Linear) and mod.bias is None:
        w = mod.weight
        if rows is not None:
            w = w[rows[0]:rows[1]]
        if cols is not None:
            w = w[:, cols[0]:cols[1]]
        return _linear(w)
    if type(mod) is PackedLinear:
        packed = slice_packed(mod.packed, rows=rows, cols=cols, what=what)
        new = PackedLinear.__new__(PackedLinear)
        nn.Module.__init__(new)
        new.packed, new.compute_dtype = packed, mod.compute_dtype
        new.out_features, new.in_features = packed.shape
        return new
    raise ConfigError(f"sharding: {what} is a {type(mod).__name__}, which cannot be split")


class _AllReduceOutput:
    """Mixed into a linear layer's class: its output (a partial sum over this rank's inputs) is all-reduced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x), "attn_wo_b_allreduce")


def row_parallel(mod: nn.Module, comm: Comm) -> nn.Module:
    """``mod`` (float or packed) with its output summed over the ranks."""
    mod.__class__ = type(f"RowParallel{type(mod).__name__}", (_AllReduceOutput, type(mod)), {})
    mod.comm = comm
    return mod


class VocabParallelEmbedding(nn.Module):
    """``embed`` of one rank: rows [v0, v1) of the vocabulary; other ids look up zeros, summed over ranks."""

    def __init__(self, weight: torch.Tensor, v0: int, comm: Comm):
        super().__init__()
        self.weight = _param(weight)
        self.v0, self.comm = v0, comm
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.v0
        mine = (local >= 0) & (local < self.num_embeddings)
        e = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        e = e.masked_fill(~mine[..., None], 0)
        return self.comm.all_reduce(e, "embed_allreduce")


class ParallelHead(nn.Module):
    """``head`` of one rank: logits of its vocabulary slice (``inner``: a float or packed linear layer),
    all-gathered to the whole vocabulary."""

    def __init__(self, inner: nn.Module, comm: Comm):
        super().__init__()
        self.inner, self.comm = inner, comm
        self.out_features, self.in_features = inner.out_features, inner.in_features

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.comm.all_gather(self.inner(h), "head_allgather"), dim=-1)


class ParallelMoE(nn.Module):
    """``ffn`` of one rank. Modes: ``tp`` (each expert's width split, one all-reduce), ``ep`` (whole experts
    per rank, tokens replicated by TP attention: one all-reduce), ``ep_dp`` (attention data parallel: each
    token dispatched to the ranks owning one of its experts, the partial outputs combined back, both by
    all-to-all; a header all-gather keeps the ranks in lock step)."""

    def __init__(self, moe: MoE, layer: int, mode: str, experts: tuple[int, int], comm: Comm, dtype: torch.dtype):
        super().__init__()
        self.gate, self.experts, self.shared_experts = moe.gate, moe.experts, moe.shared_experts
        self.layer, self.mode, self.comm = layer, mode, comm
        self.e0, self.e1 = experts
        self.top_k = moe.gate.top_k
        self.dtype = dtype  # the model's compute dtype: what an idle rank's empty dispatch buffers hold

    def _local(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Σ over the pairs routed to this rank's experts (others contribute nothing), fp32 [T, D]."""
        out = torch.zeros(x.shape, dtype=fp32(x[:0]).dtype, device=x.device)
        mine = (idx >= self.e0) & (idx < self.e1)
        t, k = mine.nonzero(as_tuple=True)
        if t.numel():
            y = self.experts(x[t], (idx[t, k] - self.e0)[:, None], w[t, k][:, None])
            out.index_add_(0, t, fp32(y))
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.gate(flat, ids.reshape(-1), None if image is None else image.reshape(-1))
        if self.mode == "tp":
            y = self.experts(flat, idx, w)
            if self.shared_experts is not None:
                y = y + self.shared_experts(flat)
            return self.comm.all_reduce(y, "moe_tp_allreduce").view(shape)
        if self.mode == "ep":
            y = self._local(flat, idx, w).to(x.dtype)
            if self.shared_experts is not None:
                y = y + self.shared_experts(flat)
            return self.comm.all_reduce(y, "moe_ep_allreduce").view(shape)
        comm = self.comm
        if comm.layout.tp_rank(comm.rank) == 0:  # a DP group's tokens leave once, from its first TP rank
            route = self._destinations(idx)
            header = comm.moe_header(self.layer, route[2])
            y = self.dp_exchange(flat, idx, w, header, route).to(x.dtype)
        else:  # the other TP ranks serve the group's experts and get the output from the all-reduce below
            header = comm.moe_header(self.layer, [0] * comm.world)
            self.dp_exchange(None, None, None, header)
            y = torch.zeros_like(flat)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)  # TP: this rank's slice of the shared expert
        if comm.layout.tp > 1:
            y = comm.all_reduce(y, "moe_dp_tp_allreduce")
        return y.view(shape)

    def _destinations(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Which rank each (token, destination) copy goes to: a token goes once to every rank owning one of its
        experts. Returns (destination rank of each copy, token of each copy, copies per rank), rank-ordered."""
        W, per = self.comm.world, self.e1 - self.e0
        owner = torch.zeros(idx.shape[0], W, dtype=torch.bool, device=idx.device)
        owner.scatter_(1, idx // per, True)
        dest, order = owner.t().nonzero(as_tuple=True)  # rank-major: every copy for rank 0 first
        return dest, order, torch.bincount(dest, minlength=W).tolist()

    def dp_exchange(self, flat, idx, w, header: list[tuple[int, list[int]]], route=None) -> torch.Tensor:
        """One DP MoE collective. Dispatch: each token goes (with its routing) only to the ranks that own one of
        its experts (variable all-to-all); each rank runs its experts of the layer the sender asked for; combine:
        the partial outputs go back the same way and are summed per token. ``flat`` None: this rank is idle and
        only serves. Returns this rank's rows, fp32 [tokens, D]."""
        comm, k, me = self.comm, self.top_k, self.comm.rank
        D, dtype, dev = self.experts.dim, self.dtype, self.gate.weight.device
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        send = header[me][1]
        recv = [counts[me] for _, counts in header]
        if flat is not None:
            _, order, _ = route
            xs = flat[order]
            meta = torch.cat([idx[order].to(torch.float64), w[order].to(torch.float64)], dim=1)
        else:
            order = torch.zeros(0, dtype=torch.long, device=dev)
            xs = torch.zeros(0, D, dtype=dtype, device=dev)
            meta = torch.zeros(0, 2 * k, dtype=torch.float64, device=dev)
        x_in = comm.all_to_all_v(xs, send, recv, "moe_dp_dispatch_x")
        m_in = comm.all_to_all_v(meta, send, recv, "moe_dp_dispatch_route")
        y_in = torch.zeros(x_in.shape[0], D, dtype=acc, device=dev)
        at = 0
        for j, n in enumerate(recv):
            if n:
                rows = slice(at, at + n)
                moe = comm.moe_layers[header[j][0]]
                y_in[rows] = moe._local(x_in[rows], m_in[rows, :k].long(), m_in[rows, k:].to(acc))
                at += n
        back = comm.all_to_all_v(y_in.to(dtype), recv, send, "moe_dp_combine")
        T = flat.shape[0] if flat is not None else 0
        return torch.zeros(T, D, dtype=acc, device=dev).index_add_(0, order, fp32(back))


def _shard_experts(experts: Experts, layout: Layout, rank: int, total: int) -> tuple[str, tuple[int, int]]:
    """Keep ``rank``'s experts (EP) or every expert's slice of the width (TP) of ``total`` experts."""
    from ..model.packed import PackedExperts

    if type(experts) not in (Experts, PackedExperts):
        raise ConfigError(f"sharding: routed experts of type {type(experts).__name__} cannot be split")
    packed = isinstance(experts, PackedExperts)
    E, I = total, experts.inter

    def cut(name: str, lead=None, rows=None, cols=None) -> None:
        if packed:
            p = getattr(experts, f"{name}_packed")
            setattr(experts, f"{name}_packed", slice_packed(p, lead, rows, cols, what=f"experts.{name}"))
            return
        w = getattr(experts, name)
        if lead is not None:
            w = w[lead[0]:lead[1]]
        if rows is not None:
            w = w[:, rows[0]:rows[1]]
        if cols is not None:
            w = w[:, :, cols[0]:cols[1]]
        setattr(experts, name, _param(w))

    if layout.ep:
        e0, e1 = split(E, layout.ep_size, rank)
        if experts.n_experts == E:  # else already kept before loading (load_model's prepare): nothing to cut
            for name in ("w1", "w2", "w3"):
                cut(name, lead=(e0, e1))
            experts.n_experts, experts.first = e1 - e0, e0
        elif (experts.first, experts.n_experts) != (e0, e1 - e0):
            raise ConfigError(f"sharding: rank {rank} holds experts {experts.first}.. but should hold {e0}..{e1 - 1}")
        return ("ep" if layout.dp == 1 else "ep_dp"), (e0, e1)
    i0, i1 = split(I, layout.tp, layout.tp_rank(rank))
    cut("w1", rows=(i0, i1))
    cut("w3", rows=(i0, i1))
    cut("w2", cols=(i0, i1))
    experts.inter = i1 - i0
    return "tp", (0, E)


def _shard_shared(shared: SharedExpert, layout: Layout, rank: int) -> None:
    if layout.tp == 1:
        return
    i0, i1 = split(shared.w1.out_features, layout.tp, layout.tp_rank(rank))
    shared.w1 = slice_linear(shared.w1, rows=(i0, i1), what="shared_experts.w1")
    shared.w3 = slice_linear(shared.w3, rows=(i0, i1), what="shared_experts.w3")
    shared.w2 = slice_linear(shared.w2, cols=(i0, i1), what="shared_experts.w2")


def _shard_attention(attn, layout: Layout, rank: int, comm: Comm) -> None:
    tp, r = layout.tp, layout.tp_rank(rank)
    if tp == 1:
        return
    H, G, hd = attn.n_heads, attn.o_groups, attn.head_dim
    h0, h1 = split(H, tp, r)
    g0, g1 = split(G, tp, r)
    rank_o = attn.wo_a.out_features // G  # o_lora_rank
    where = f"layer {attn.layer} attn"
    attn.wq_b = slice_linear(attn.wq_b, rows=(h0 * hd, h1 * hd), what=f"{where}.wq_b")
    attn.attn_sink = _param(attn.attn_sink[h0:h1])
    attn.wo_a = slice_linear(attn.wo_a, rows=(g0 * rank_o, g1 * rank_o), what=f"{where}.wo_a")
    attn.wo_b = row_parallel(slice_linear(attn.wo_b, cols=(g0 * rank_o, g1 * rank_o), what=f"{where}.wo_b"), comm)
    attn.n_heads, attn.o_groups = h1 - h0, g1 - g0


def keep_rank_experts(model, layout: Layout, rank: int) -> None:
    """Expert parallel: keep only ``rank``'s routed experts, on the still-empty ``meta`` model before a checkpoint
    is read (``load_model(prepare=...)``), so the rank reads and holds only its experts' tensors."""
    if not layout.ep or not layout.sharded:
        return
    with torch.no_grad():
        for block in model.layers:
            _shard_experts(block.ffn.experts, layout, rank, model.cfg.n_routed_experts)


def shard_model(model, layout: Layout, rank: int, comm: Comm):
    """Keep ``rank``'s slices of ``model`` (in place) and wire its collectives through ``comm``."""
    layout.check(model.cfg)
    if not layout.sharded:
        return model
    tp, r = layout.tp, layout.tp_rank(rank)
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            _shard_attention(block.attn, layout, rank, comm)
            moe = block.ffn
            mode, experts = _shard_experts(moe.experts, layout, rank, model.cfg.n_routed_experts)
            if moe.shared_experts is not None:
                _shard_shared(moe.shared_experts, layout, rank)
            block.ffn = ParallelMoE(moe, i, mode, experts, comm, model.dtype)
            if comm is not None:  # None: sizing only (flashserve.parallel.memory), never run
                comm.moe_layers[i] = block.ffn
        if tp > 1:
            _plain(model.embed, nn.Embedding, "embed")
            v0, v1 = split(model.cfg.vocab_size, tp, r)
            model.embed = VocabParallelEmbedding(model.embed.weight[v0:v1], v0, comm)
            model.head = ParallelHead(slice_linear(model.head, rows=(v0, v1), what="head"), comm)
    model.parallel = (layout, rank)
    return model
