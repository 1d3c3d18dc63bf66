"""Routed experts streamed from the checkpoint under a memory budget (``load_model(weight_memory=...)``).

A layer's :class:`~flashserve.model.moe.Experts` then holds ``slots`` experts, fewer than the router chooses from;
an :class:`ExpertCache` keeps which expert each slot holds. When the router has chosen a step's experts, the ones
not held are read from the checkpoint's files into slots (evicting the least recently used, or the least used:
``policy``), on a background thread while the layer's shared expert is computed, and the routing indices are
mapped to slots; the experts' products are those of the unbudgeted model. A step that routes to more experts than
a layer has slots runs them a slotful at a time (the other pairs weighted zero). The counts (hits, misses, bytes
read) go to the engine's stats, ``/metrics`` and the periodic log.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

LRU, LFU = "lru", "lfu"
POLICIES = (LRU, LFU)
# LFU's counts halve every this many steps of a layer, so that the experts used most lately win over those used
# most long ago (the halving SGLang's and the GPU split's resident experts use, flashserve.model.hybrid)
LFU_HALVING_STEPS = 256

# reader(experts module, projection name, slot) -> bytes read: fills one projection of one expert into a slot
Reader = Callable[[torch.nn.Module, str, int], int]


class ExpertCache:
    """The slots of one layer's routed experts and the expert each holds."""

    def __init__(self, experts: torch.nn.Module, n_experts: int, readers: dict[int, dict[str, Reader]],
                 held: list[int], policy: str = LRU):
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.experts, self.n_experts, self.readers, self.policy = experts, n_experts, readers, policy
        self.slots = experts.n_experts
        self.owner = list(held)  # the expert in each slot (-1: none)
        self.recency = OrderedDict((e, None) for e in held)  # least recently used first
        self.uses: Counter[int] = Counter()
        self.table = torch.zeros(n_experts, dtype=torch.long)  # expert -> its slot (where held)
        self.table[torch.tensor(held, dtype=torch.long)] = torch.arange(len(held))
        self.hits = self.misses = self.bytes_read = 0
        self.empty: list[int] = []  # slots holding no expert (a read into them failed part way)
        self.steps = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flashserve-experts")
        self._ticket: tuple[list[list[int]], Future] | None = None
        # reading ahead: the next streamed layer of a forward and its router (set by the loader), the experts read
        # ahead and not used yet, and the counts
        self.next: ExpertCache | None = None
        self.next_gate: torch.nn.Module | None = None
        self.ahead: set[int] = set()
        self.ahead_read = self.ahead_used = 0

    def _victim(self, keep: set[int]) -> int:
        """The slot to give up: an empty one, else the one whose expert is not wanted now and least recently used
        (LRU) or least used, the least recent of those first (LFU)."""
        if self.empty:
            return self.empty.pop()
        free = (e for e in self.recency if e not in keep)
        expert = next(free) if self.policy == LRU else min(free, key=lambda e: self.uses[e])  # min keeps the first
        return int(self.table[expert])

    def _ensure(self, wanted: list[int], ahead: bool = False) -> None:
        """Hold every expert of ``wanted`` (at most ``slots`` of them), reading the missing ones, their reads first
        announced together (``posix_fadvise``: the disk serves them at once). A read that fails (a file changed
        since loading, a disk error) leaves its slot empty, to be filled by a later miss, and raises. ``ahead``: a
        guess of the next step's experts (:meth:`read_ahead`), counted apart from the step's hits and misses."""
        keep = set(wanted)
        if not ahead:
            self.steps += 1
            if self.policy == LFU and self.steps % LFU_HALVING_STEPS == 0:
                self.uses = Counter({e: n // 2 for e, n in self.uses.items() if n > 1})
        missing = [e for e in wanted if e not in self.recency]
        if len(missing) > 1:
            for e in missing:
                for read in self.readers[e].values():
                    getattr(read, "advise", lambda: None)()
        with torch.no_grad():
            for e in wanted:
                if ahead:
                    if e in self.recency:
                        self.recency.move_to_end(e)
                        continue
                else:
                    self.uses[e] += 1
                    if e in self.ahead:
                        self.ahead.discard(e)
                        self.ahead_used += 1
                    if e in self.recency:
                        self.hits += 1
                        self.recency.move_to_end(e)
                        continue
                    self.misses += 1
                slot = self._victim(keep)
                if self.owner[slot] >= 0:
                    del self.recency[self.owner[slot]]
                    self.ahead.discard(self.owner[slot])  # a guess given up unused
                self.owner[slot] = -1
                try:
                    for name, read in self.readers[e].items():
                        self.bytes_read += read(self.experts, name, slot)
                except BaseException:
                    self.empty.append(slot)
                    raise
                self.owner[slot] = e
                self.recency[e] = None
                self.table[e] = slot
                if ahead:
                    self.ahead.add(e)
                    self.ahead_read += 1

    def prefetch(self, idx: torch.Tensor, x: torch.Tensor | None = None,
                 ids: torch.Tensor | None = None) -> tuple[list[list[int]], Future]:
        """Start reading the experts ``idx`` routes to (first slotful) on the background thread; with this layer's
        input ``x`` [T, D] (and the tokens ``ids`` [T], for a hash-routed layer), the next layer's guess of its
        own (:meth:`read_ahead`) on that layer's."""
        chosen = idx.unique().tolist()  # on the host (a compiled step: behind streamed_ops' operator)
        groups = [chosen[i:i + self.slots] for i in range(0, len(chosen), self.slots)]
        ticket = groups, self._pool.submit(self._ensure, groups[0])
        if x is not None and self.next is not None and self.next_gate is not None:
            self.next.read_ahead(self.next_gate, x, ids)
        return ticket

    def read_ahead(self, gate: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor | None) -> None:
        """While the layer before runs, guess this layer's experts by its router applied to that layer's input
        (the residual stream changes little from one layer to the next: the guess of pre-gated MoE and of
        offloading engines), and read the ones not held, at most half the slots, on this layer's thread, queued
        before its own step's reads. ``ahead_used`` against ``ahead_read`` says how good the guesses are."""
        x = x.detach().clone()  # the caller's buffer may be reused before the thread reads it
        ids = None if ids is None else ids.detach().clone()
        self._pool.submit(self._guess, gate, x, ids)

    def _guess(self, gate: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor | None) -> None:
        with torch.inference_mode():
            idx, _ = gate(x, ids, None)
        guess = [e for e in idx.unique().tolist() if e not in self.recency][:max(self.slots // 2, 1)]
        if guess:
            self._ensure(guess, ahead=True)

    def run(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
            ticket: tuple[list[list[int]], Future]) -> torch.Tensor:
        """The routed experts' sum for ``x [T, D]`` (``idx``/``w`` [T, k] from the router), as the experts of an
        unbudgeted layer compute it."""
        groups, read = ticket
        read.result()
        if len(groups) == 1:
            return self.experts(x, self.table[idx], w)
        out = None
        for i, group in enumerate(groups):
            if i:
                self._ensure(group)
            inside = torch.isin(idx, torch.tensor(group, dtype=idx.dtype))
            slots = torch.where(inside, self.table[idx], self.table[group[0]])
            part = self.experts(x, slots, torch.where(inside, w, torch.zeros_like(w)))
            out = part if out is None else out + part
        return out

    def start(self, idx: torch.Tensor, x: torch.Tensor | None = None, ids: torch.Tensor | None = None) -> None:
        """:meth:`prefetch`, the ticket kept for :meth:`finish` (the operator ``flashserve::experts_start``)."""
        self._ticket = self.prefetch(idx, x, ids)

    def finish(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """:meth:`run` with the ticket :meth:`start` kept (the operator ``flashserve::experts_run``)."""
        ticket, self._ticket = self._ticket, None
        if ticket is None:
            raise RuntimeError("experts_run without experts_start")
        return self.run(x, idx, w, ticket)

    def counts(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "bytes_read": self.bytes_read,
                "read_ahead": self.ahead_read, "read_ahead_used": self.ahead_used}


def expert_caches(model: torch.nn.Module) -> list[ExpertCache]:
    """``model``'s expert caches (none without a budget)."""
    return [m.expert_cache for m in model.modules() if getattr(m, "expert_cache", None) is not None]


def cache_stats(caches: list[ExpertCache]) -> dict | None:
    """Hits, misses and bytes read summed over ``caches`` (:func:`expert_caches`), with the slots and experts of a
    layer; None without any."""
    if not caches:
        return None
    out = {"hits": 0, "misses": 0, "bytes_read": 0, "read_ahead": 0, "read_ahead_used": 0}
    for c in caches:
        for k, v in c.counts().items():
            out[k] += v
    out.update(layers=len(caches), slots=caches[0].slots, experts=caches[0].n_experts, policy=caches[0].policy)
    return out
