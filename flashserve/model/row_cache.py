"""Engram rows streamed from the checkpoint under a memory budget (``load_model(weight_memory=...)``).

An engram table (V4.1-Flash: 384M rows a layer, 185 GiB in all) then holds only ``slots`` of its rows, in a
set-associative cache: row ``r`` may sit in one of ``WAYS`` slots of set ``hash(r) % sets``, the least recently used
of them giving way (a CPU cache's rule: no per-row bookkeeping beyond a tag and an age, so the cache's overhead is
16 bytes a slot, where a dictionary would cost more than the rows it maps). A step's row ids are known before its
first layer runs (they hash the tokens), so the rows a step misses are read from the checkpoint's files with
``pread`` on a background thread while the layers before the engram layer run (:meth:`RowCache.prefetch`); the rows
it gathers are those of the whole table, bit for bit. A step whose rows crowd more than ``WAYS`` into one set is
served a wayful at a time. The counts (hits, misses, bytes read) go to the engine's stats, ``/metrics`` and the
periodic log.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable

import numpy as np
import torch
from torch import nn

from . import streamed_ops

WAYS = 16
MIN_ROWS = 4096  # the least a streamed table holds (a 170-token step of V4.1-Flash's 24 lookups a token)
_MIX = 2654435761  # Knuth's multiplier: spreads row ids over the sets (a row id below 2**31 times it fits int64)

# reader(held table, row ids [N], slots [N]) -> bytes read: fills those slots with those rows of the checkpoint's table
RowReader = Callable[[nn.Module, np.ndarray, np.ndarray], int]


def _rank_within(keys: np.ndarray) -> np.ndarray:
    """For each element of ``keys`` [N], how many earlier elements have the same key (0, 1, ...)."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    n = np.arange(len(keys))
    run_start = np.maximum.accumulate(np.where(np.r_[True, ordered[1:] != ordered[:-1]], n, 0))
    rank = np.empty_like(order)
    rank[order] = n - run_start
    return rank


class Sets:
    """Which row each slot of a set-associative cache holds (``sets`` x ``ways``), and when each was last used;
    what was found and read (plain attributes: a module's ``__setattr__`` would cost more than a step's rows)."""

    def __init__(self, slots: int, ways: int, read: Callable[[np.ndarray, np.ndarray], int]):
        self.ways = min(ways, slots)
        self.sets = slots // self.ways
        self.read = read  # read(rows [N], slots [N]) -> bytes
        self.tags = np.full((self.sets, self.ways), -1, dtype=np.int64)  # the row in each slot (-1: empty)
        self.age = np.zeros((self.sets, self.ways), dtype=np.int64)
        self.clock = 0
        self.hits = self.misses = self.bytes_read = 0

    def of(self, rows: np.ndarray) -> np.ndarray:
        return rows * _MIX % self.sets

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The distinct rows of ``ids``, each id's index into them, the rows' sets, and each row's wayful group (0
        unless more than ``ways`` of them fall into one set)."""
        rows, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        sets = self.of(rows)
        crowded = len(np.unique(sets)) < len(sets)
        group = _rank_within(sets) // self.ways if crowded else np.zeros_like(rows)
        return rows, inverse.reshape(-1), sets, group

    def place(self, rows: np.ndarray, sets: np.ndarray) -> np.ndarray:
        """Slots [N] holding the distinct ``rows`` [N] (at most ``ways`` of them a set; ``sets`` theirs), reading the
        missing ones."""
        self.clock += 1
        found = self.tags[sets] == rows[:, None]  # [N, ways]
        hit = found.any(1)
        way = found.argmax(1)
        self.age[sets[hit], way[hit]] = self.clock  # in use now: not a victim for this call's misses
        miss = ~hit
        n_miss = int(miss.sum())
        if n_miss:
            m_sets = sets[miss]
            # the k-th miss of a set takes its k-th oldest slot; a slot used now is the newest, and a set has at
            # most ``ways`` rows here, so no row this call gathers is evicted
            ages = self.age[m_sets]
            if len(np.unique(m_sets)) == n_miss:
                m_way = ages.argmin(1)
            else:
                order = np.argsort(ages, axis=1, kind="stable")
                m_way = np.take_along_axis(order, _rank_within(m_sets)[:, None], 1)[:, 0]
            way[miss] = m_way
            self.tags[m_sets, m_way] = -1  # empty until read: a read that fails leaves them empty, never wrong
            self.age[m_sets, m_way] = self.clock
            self.bytes_read += self.read(rows[miss], m_sets * self.ways + m_way)
            self.tags[m_sets, m_way] = rows[miss]
        self.hits += len(rows) - n_miss
        self.misses += n_miss
        return sets * self.ways + way

    def placed(self, ids: np.ndarray) -> np.ndarray | None:
        """Each id's slot [N], the missing rows read; None (nothing placed) when a set is crowded."""
        rows, inverse, sets, group = self.rows(ids)
        if len(rows) and int(group.max()) > 0:
            return None
        return self.place(rows, sets)[inverse]


class RowCache(nn.Module):
    """An engram table of ``rows`` rows of which ``held`` (a table of ``slots`` rows, the same module type as the
    table: :class:`~flashserve.model.packed.PackedEmbedding` or ``nn.Embedding``) holds the recently used;
    ``read`` fills slots from the checkpoint. The bookkeeping is numpy's (:class:`Sets`: a decode step's few dozen
    rows, where torch's per-op overhead would cost more than the rows' reads)."""

    streamed_from_checkpoint = True  # its tensors are slots, not checkpoint tensors (Transformer.checkpoint_tensors)

    def __init__(self, rows: int, held: nn.Module, read: RowReader | None = None, ways: int = WAYS):
        super().__init__()
        slots = held.weight.shape[0] if isinstance(held, nn.Embedding) else held.packed.shape[0]
        self.rows, self.held, self.read = rows, held, read
        self.sets = Sets(slots, ways, lambda r, s: self.read(self.held, r, s))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flashserve-rows")
        self._pending: tuple[np.ndarray, Future] | None = None

    @property
    def slots(self) -> int:
        return self.sets.sets * self.sets.ways

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start placing the rows ``ids`` names on the background thread (:meth:`forward` with the same ids waits for
        it); a step's ids are known before its first layer."""
        if self._pending is not None:  # a step that ended before its engram layer: its reads done (or failed)
            wait([self._pending[1]])
        host = ids.cpu().numpy()
        self._pending = host, self._pool.submit(self.sets.placed, host)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The table's rows ``ids`` [...] → [..., dim], as the whole table gives them: :meth:`gather` behind the
        operator ``flashserve::rows_gather`` (a compiled step calls it as a kernel), once the loader has keyed
        this cache (:func:`flashserve.model.streamed_ops.key_of`)."""
        key = getattr(self, "cache_key", None)
        if key is None:
            return self.gather(ids)
        return streamed_ops.rows_gather(ids, key, self.like)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` [...] → [..., dim], the missing ones read first (on the host)."""
        host = ids.cpu().numpy()
        placed = None
        if self._pending is not None:
            sent, ticket = self._pending
            self._pending = None
            placed = ticket.result()
            if not np.array_equal(sent, host):
                placed = None
        if placed is None:
            placed = self.sets.placed(host)
        if placed is not None:
            return self.held(torch.from_numpy(placed).view(ids.shape).to(ids.device))
        # crowded sets: a wayful group at a time, each gathered before the next one's rows evict it
        rows, inverse, sets, group = self.sets.rows(host)
        out = None
        for g in range(int(group.max()) + 1):
            mine = group == g
            slots = np.zeros_like(rows)
            slots[mine] = self.sets.place(rows[mine], sets[mine])
            taken = mine[inverse]
            part = self.held(torch.from_numpy(slots[inverse][taken]).to(ids.device))
            if out is None:
                out = part.new_empty(host.size, part.shape[-1])
            out[torch.from_numpy(taken).to(ids.device)] = part
        return out.view(*ids.shape, -1)

    @property
    def weight(self) -> torch.Tensor:
        """What code reading ``embed.weight`` (its dtype) expects: the held rows."""
        return self.held.weight

    def counts(self) -> dict[str, int]:
        s = self.sets
        return {"hits": s.hits, "misses": s.misses, "bytes_read": s.bytes_read}


def row_caches(model: nn.Module) -> list[RowCache]:
    return [m for m in model.modules() if isinstance(m, RowCache)]


def row_cache_stats(caches: list[RowCache]) -> dict | None:
    """Hits, misses and bytes read summed over ``caches``, with the rows held and the tables' rows; None without
    any."""
    if not caches:
        return None
    out = {"hits": 0, "misses": 0, "bytes_read": 0}
    for c in caches:
        for k, v in c.counts().items():
            out[k] += v
    out.update(layers=len(caches), slots=sum(c.slots for c in caches), rows=sum(c.rows for c in caches))
    return out
