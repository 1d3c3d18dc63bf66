"""Routed experts split between a GPU and the host (``load_model(..., gpu_experts=N)``, ``--gpu-experts N``).

What ktransformers does and llama.cpp's ``--n-cpu-moe``/``-ot exps=CPU`` approximate: attention, the dense layers,
the shared experts and the caches live on the GPU; each MoE layer holds ``N`` of its routed experts there, in slots,
and every expert stays in host memory (mapped from the checkpoint), where the CPU kernels compute the pairs routed to
experts the GPU does not hold. A step's pairs are split by the routing: the held ones run on the GPU (launched
first, so the two sides overlap), the others on the host, and their sums are added on the GPU. The routing is read
on the host, so decode runs eagerly.

Which experts a layer holds follows use, as SGLang's frequency-based resident experts: every layer counts its
routed pairs on the device, and :func:`rebalance` (the engine calls it every :data:`REBALANCE_STEPS` steps) moves
the most used experts into the slots, copying only those that change, then halves the counts so the placement
follows the traffic. Loaded, a layer holds experts ``0..N-1``.

Products are the unsplit layer's up to the order of the additions (each side sums its own pairs); greedy tokens
are the unsplit engine's (tested on the CPU, both sides there).
"""

from __future__ import annotations

import torch
from torch import nn

from .moe import MoE
from .norms import fp32
from .packed import PackedExperts

REBALANCE_STEPS = 256
NAMES = ("w1", "w2", "w3")


def _expert(experts: nn.Module, e: int) -> list[torch.Tensor]:
    """Expert ``e``'s stored tensors (each projection's bytes and scales, or float weights), any experts module."""
    if isinstance(experts, PackedExperts):
        return [t for n in NAMES for t in (getattr(experts, f"{n}_packed").qweight[e],
                                           getattr(experts, f"{n}_packed").scale[e])]
    matrices = getattr(experts, "matrices", None)
    if matrices is not None:  # mapped_experts.MappedExperts: one matrix an expert
        return [t for n in NAMES for t in matrices[n][e]]
    return [getattr(experts, n)[e] for n in NAMES]


def _slots_like(experts: nn.Module, slots: int) -> nn.Module:
    """An empty experts module of ``experts``' kind and format with ``slots`` experts (on the CPU): stacked packed
    experts for packed or mapped ones, stacked float experts for float ones."""
    if isinstance(experts, PackedExperts) or hasattr(experts, "matrices"):
        fmt = experts.w1_packed.fmt if isinstance(experts, PackedExperts) else experts.fmt
        return PackedExperts(slots, experts.dim, experts.inter, experts.limit, fmt)
    return type(experts)(slots, experts.dim, experts.inter, experts.limit).to(experts.w1.dtype)


class HybridExperts(nn.Module):
    """A layer's routed experts: ``held`` (slots on the device) and ``host`` (every expert, in host memory)."""

    def __init__(self, host: nn.Module, slots: int):
        super().__init__()
        object.__setattr__(self, "host", host)  # not a submodule: model.to(device) leaves it in host memory
        self.n_experts, self.dim, self.inter, self.limit = host.n_experts, host.dim, host.inter, host.limit
        self.first = getattr(host, "first", 0)
        self.held = _slots_like(host, slots)
        self.owner = [-1] * slots  # the expert in each slot
        self.register_buffer("table", torch.full((host.n_experts,), -1, dtype=torch.long), persistent=False)
        self.register_buffer("uses", torch.zeros(host.n_experts, dtype=torch.long), persistent=False)
        self.copied = 0  # experts copied into slots so far
        self.pairs_held = self.pairs = 0  # routed pairs on held experts, and all, counted at each rebalance

    @property
    def slots(self) -> int:
        return len(self.owner)

    @torch.no_grad()
    def place(self, experts: list[int]) -> int:
        """Hold ``experts`` (at most ``slots``), keeping those already held in their slots; returns how many were
        copied in."""
        want = list(dict.fromkeys(experts))[:self.slots]
        free = [s for s, e in enumerate(self.owner) if e not in want]
        moved = 0
        for e in want:
            if e in self.owner:
                continue
            s = free.pop(0)
            if self.owner[s] >= 0:
                self.table[self.owner[s]] = -1
            for dst, src in zip(_expert(self.held, s), _expert(self.host, e), strict=True):
                dst.copy_(src)
            self.owner[s] = e
            self.table[e] = s
            moved += 1
        self.copied += moved
        return moved

    def rebalance(self) -> int:
        """Hold the most used experts since the last call (ties: the lower id); halve the counts."""
        uses = self.uses.cpu()
        held = self.table.cpu() >= 0
        self.pairs_held += int(uses[held].sum())  # counted at the engine's rebalance, which syncs anyway
        self.pairs += int(uses.sum())
        top = torch.sort(uses, descending=True, stable=True).indices[:self.slots].tolist()
        self.uses //= 2
        return self.place(sorted(top, key=lambda e: e not in self.owner))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Σ_k w[t,k] · expert_{idx[t,k]}(x_t): the held pairs on ``x``'s device, the others on the host."""
        T, k = idx.shape
        self.uses += torch.bincount(idx.flatten(), minlength=self.n_experts)
        slot = self.table[idx].flatten()
        held = (slot >= 0).cpu()  # the host sync of a hybrid step
        rows = torch.arange(T).repeat_interleave(k)
        out = torch.zeros(T, x.shape[-1], dtype=fp32(x[:0]).dtype, device=x.device)
        if held.any():  # launched first: the device works while the host computes its pairs
            pick = held.nonzero()[:, 0].to(x.device)
            r = rows.to(x.device)[pick]
            out.index_add_(0, r, fp32(self.held(x[r], slot[pick][:, None], w.flatten()[pick][:, None])))
        if not held.all():
            pick = (~held).nonzero()[:, 0]
            r = rows[pick]
            y = self.host(x.cpu()[r], idx.flatten().cpu()[pick][:, None], w.flatten().cpu()[pick][:, None])
            out.index_add_(0, r.to(x.device), fp32(y).to(x.device))
        return out.to(x.dtype)


def hybridize(model: nn.Module, slots: int) -> int:
    """Give every MoE layer of ``model`` (on the CPU, its experts loaded) :class:`HybridExperts` of ``slots``
    held experts, holding experts ``0..slots-1``; call before ``model.to(device)``. Returns how many layers."""
    done = 0
    for m in model.modules():
        if isinstance(m, MoE) and not isinstance(m.experts, HybridExperts):
            if slots >= m.experts.n_experts:
                continue
            m.experts = HybridExperts(m.experts, slots)
            m.experts.place(list(range(slots)))
            done += 1
    return done


def hybrid_layers(model: nn.Module) -> list[HybridExperts]:
    return [m for m in model.modules() if isinstance(m, HybridExperts)]


def rebalance(layers: list[HybridExperts]) -> int:
    """:meth:`HybridExperts.rebalance` every layer; returns the experts copied."""
    return sum(layer.rebalance() for layer in layers)


def hybrid_stats(layers: list[HybridExperts]) -> dict | None:
    """The share of routed pairs that ran on held experts (counted at each rebalance; the counts then halve, so
    recent traffic weighs more) and the experts copied into slots so far; None without a split."""
    if not layers:
        return None
    held, total = sum(layer.pairs_held for layer in layers), sum(layer.pairs for layer in layers)
    return {"layers": len(layers), "slots": layers[0].slots, "experts": layers[0].n_experts,
            "held_share": held / total if total else 0.0, "copied": sum(layer.copied for layer in layers)}
