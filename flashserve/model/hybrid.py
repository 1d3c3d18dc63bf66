"""Routed experts split between a GPU and the host (``load_model(..., gpu_experts=N)``, ``--gpu-experts N``).

What ktransformers does and llama.cpp's ``--n-cpu-moe``/``-ot exps=CPU`` approximate: attention, the dense layers,
the shared experts and the caches live on the GPU; each MoE layer holds ``N`` of its routed experts there, in slots,
and every expert stays in host memory (mapped from the checkpoint), where the CPU kernels compute the pairs routed to
experts the GPU does not hold.

A step of a layer (:meth:`HybridExperts.forward`):

1. the activations, routing indices and weights are copied to the host first (asynchronously, into pinned buffers
   where the device is CUDA; :class:`Staging`), and the host waits on an event recorded after these copies only;
2. the split is made on the host: the positions of the held experts' pairs, grouped by slot there, go to the
   device in one small copy, and their products are launched on the GPU, a product per projection and hit slot,
   without waiting on the device (:meth:`HybridExperts._launch_held`);
3. while the GPU runs them, the CPU kernels compute the other pairs and sum them per token in a pinned buffer;
4. that sum is copied to the device (asynchronously) and added to the GPU's.

The host thus starts as soon as the routing is known instead of behind the GPU's expert products. The routing is
read on the host, so decode runs eagerly. On a CPU device (the tests run both sides there) the same steps run,
through ordinary buffers: pinning needs CUDA.

Which experts a layer holds follows measured use, as SGLang's frequency-based placement does: every layer counts
its routed pairs per expert (on the host, from the copied routing), and a rebalance moves the most used experts into
the slots, copying only those that change (ties keep the held ones), then halves the counts so that the placement
follows the traffic. A layer rebalances itself at its 1st, 2nd, 4th, 8th ... step while that is below
:data:`REBALANCE_STEPS`, each time before computing the step, with the step's own routing counted: its first step
already runs with the experts that step uses most, and placement settles within a few steps; from then on the
engine calls :func:`rebalance` every :data:`REBALANCE_STEPS` steps. An engine's warm-up steps count like any other;
their weight is halved away by the next rebalances. Loaded, before any step, a layer holds experts ``0..N-1``.

Products are the unsplit layer's up to the order of the additions (each side sums its own pairs); greedy tokens
are the unsplit engine's (tested on the CPU, both sides there).
"""

from __future__ import annotations

import torch
from torch import nn

from .moe import MoE, clamped_swiglu
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


class Staging:
    """The host buffers a split step copies through, shared by a model's layers (one layer runs at a time).

    With a CUDA device they are pinned, so that copies in both directions are asynchronous. Each buffer is kept and
    reused across steps and layers, and replaced by a larger one (twice the old size at least) only when a step
    needs more. Reuse is safe on one stream: a layer writes a buffer only after waiting for its own copies to the
    host, which follow every earlier copy from these buffers to the device."""

    def __init__(self):
        self.buffers: dict[tuple[str, torch.dtype, bool], torch.Tensor] = {}
        self.grown = 0  # buffers allocated so far

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A ``shape`` view of the buffer ``name`` of ``dtype`` (pinned or not), grown if it is too small."""
        n = 1
        for s in shape:
            n *= s
        key = (name, dtype, pin)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < n:
            size = n if buf is None else max(n, 2 * buf.numel())
            with torch.inference_mode(False):  # updated in place under inference mode and outside it
                buf = torch.empty(size, dtype=dtype, pin_memory=pin)
            self.buffers[key] = buf
            self.grown += 1
        return buf[:n].view(shape)

    def fetch(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host copies of ``tensors`` (all on one device), complete on return; with CUDA the copies are queued
        asynchronously and the host waits on them only (and on what the stream ran before them)."""
        cuda = tensors[0].is_cuda
        out = [self.buffer(f"fetch{i}", tuple(t.shape), t.dtype, cuda) for i, t in enumerate(tensors)]
        for dst, src in zip(out, tensors, strict=True):
            dst.copy_(src, non_blocking=cuda)
        if cuda:
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        return out

    def send(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (one of this staging's buffers) on ``device``: an asynchronous copy from pinned memory with CUDA;
        ``t`` itself on the CPU, to be used before the buffer's next use."""
        return t.to(device, non_blocking=True)


class HybridExperts(nn.Module):
    """A layer's routed experts: ``held`` (slots on the device) and ``host`` (every expert, in host memory)."""

    def __init__(self, host: nn.Module, slots: int, staging: Staging | None = None):
        super().__init__()
        object.__setattr__(self, "host", host)  # not a submodule: model.to(device) leaves it in host memory
        self.n_experts, self.dim, self.inter, self.limit = host.n_experts, host.dim, host.inter, host.limit
        self.first = getattr(host, "first", 0)
        self.held = _slots_like(host, slots)
        self.staging = staging if staging is not None else Staging()
        self.owner = [-1] * slots  # the expert in each slot
        self.table = torch.full((host.n_experts,), -1, dtype=torch.long)  # each expert's slot (host memory)
        self.uses = torch.zeros(host.n_experts, dtype=torch.long)  # routed pairs per expert, halved at rebalances
        self.steps = 0  # forward calls so far
        self.copied = 0  # experts copied into slots so far
        self.pairs_held = self.pairs = 0  # routed pairs run on held experts, and all, since loaded

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
        """Hold the most used experts by the counts (ties: a held one, then the lower id); halve the counts."""
        score = self.uses * 2 + (self.table >= 0)  # the held bit only breaks ties
        top = torch.sort(score, descending=True, stable=True).indices[:self.slots].tolist()
        self.uses //= 2
        return self.place(top)

    def _launch_held(self, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, pick: torch.Tensor,
                     slot: torch.Tensor) -> None:
        """Add the pairs ``pick`` (flat positions in the step's ``[T, k]`` routing; ``slot``: each position's slot,
        on the host) to ``out``, computed by the held experts on ``out``'s device: grouped by slot on the host, the
        positions sent in one copy, one product per projection and hit slot. Nothing here waits for the device:
        the counts per slot are the host's (an experts module's own grouping would read them from the device)."""
        pick = pick[torch.argsort(slot[pick], stable=True)]
        counts = torch.bincount(slot[pick], minlength=self.slots).tolist()
        which = self.staging.buffer("which", (len(pick),), torch.long, out.is_cuda)
        which.copy_(pick)
        which = self.staging.send(which, out.device)
        rows, wts = which // w.shape[1], w.flatten()[which]
        held, pos = self.held, 0
        for s, n in enumerate(counts):
            if n:
                t = rows[pos:pos + n]
                h = x[t]
                y = held.expert_mm("w2", clamped_swiglu(held.expert_mm("w1", h, s), held.expert_mm("w3", h, s),
                                                        self.limit), s)
                out.index_add_(0, t, fp32(y) * wts[pos:pos + n, None])
                pos += n

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Σ_k w[t,k] · expert_{idx[t,k]}(x_t): the held pairs on ``x``'s device, the others on the host."""
        T, k = idx.shape
        x_h, idx_h, w_h = self.staging.fetch(x, idx, w)  # first: the host's share needs only these
        flat = idx_h.flatten()
        self.steps += 1
        self.uses += torch.bincount(flat, minlength=self.n_experts)
        if self.steps < REBALANCE_STEPS and self.steps & (self.steps - 1) == 0:  # steps 1, 2, 4, 8 ...
            self.rebalance()
        slot = self.table[flat]
        held = slot >= 0
        n_held = int(held.sum())
        self.pairs_held += n_held
        self.pairs += flat.numel()
        acc = fp32(x[:0]).dtype
        out = torch.zeros(T, x.shape[-1], dtype=acc, device=x.device)
        if n_held:  # launched before the host computes: the device works meanwhile
            self._launch_held(out, x, w, held.nonzero()[:, 0], slot)
        if n_held < flat.numel():
            pick = (~held).nonzero()[:, 0]
            r = pick // k
            y = self.host(x_h[r], flat[pick][:, None], w_h.flatten()[pick][:, None])
            part = self.staging.buffer("part", (T, x.shape[-1]), acc, x.is_cuda).zero_()
            part.index_add_(0, r, fp32(y))
            out += self.staging.send(part, x.device)
        return out.to(x.dtype)


def hybridize(model: nn.Module, slots: int) -> int:
    """Give every MoE layer of ``model`` (on the CPU, its experts loaded) :class:`HybridExperts` of ``slots``
    held experts, holding experts ``0..slots-1`` until their first step, and one :class:`Staging` for all; call
    before ``model.to(device)``. Returns how many layers."""
    done, staging = 0, Staging()
    for m in model.modules():
        if isinstance(m, MoE) and not isinstance(m.experts, HybridExperts):
            if slots >= m.experts.n_experts:
                continue
            m.experts = HybridExperts(m.experts, slots, staging)
            m.experts.place(list(range(slots)))
            done += 1
    return done


def hybrid_layers(model: nn.Module) -> list[HybridExperts]:
    return [m for m in model.modules() if isinstance(m, HybridExperts)]


def rebalance(layers: list[HybridExperts]) -> int:
    """:meth:`HybridExperts.rebalance` every layer; returns the experts copied."""
    return sum(layer.rebalance() for layer in layers)


def hybrid_stats(layers: list[HybridExperts]) -> dict | None:
    """The share of routed pairs that ran on held experts since the model was loaded and the experts copied into
    slots so far; None without a split."""
    if not layers:
        return None
    held, total = sum(layer.pairs_held for layer in layers), sum(layer.pairs for layer in layers)
    return {"layers": len(layers), "slots": layers[0].slots, "experts": layers[0].n_experts,
            "held_share": held / total if total else 0.0, "copied": sum(layer.copied for layer in layers)}
