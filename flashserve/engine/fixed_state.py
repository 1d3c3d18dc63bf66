"""The cache view of a fixed-shape step: every shape follows from sizes the host knows before the step, and
nothing reads a tensor value back to the host, so the step can be compiled (or captured) once per bucket.

It differs from :class:`~flashserve.engine.batch_state.BatchState` (the dynamic path it is tested against) in three
places, each trading a little wasted arithmetic for a fixed shape:

* compressor rings are read whole (``ratio - 1`` rows), with the first position each slot still holds
  reported through :meth:`raw_held_from` so rows not held are masked as absent;
* every group a forward *could* complete is written, the ones it did not complete to the scratch page;
* global caches are read over the page table's full width (a host-known size).
"""

from __future__ import annotations

import torch

from ..model.state import CacheKey, Replay
from .batch_state import BatchState
from .cache import KVCache


class FixedBatchState(BatchState):
    """:class:`~flashserve.model.state.SequenceState` over padded batch rows given as tensors.

    ``slots`` [B] and ``table`` [B, P] come from the step's metadata; padding rows name the cache's scratch
    slot and scratch page, so whatever they write lands where nothing reads.
    """

    fixed_shape = True

    def __init__(self, cache: KVCache, slots: torch.Tensor, table: torch.Tensor):
        self._setup(cache, slots, table)
        self._held: dict[CacheKey, torch.Tensor] = {}

    def compressor_raw(self, key: CacheKey, raw: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
        ring = self.layers[key.layer].ring(key)
        if ring is None:
            return raw
        cap, S = ring.capacity, raw.shape[1]
        slots = self.slots[:, None]
        pos = self.start[:, None] - cap + torch.arange(cap, device=raw.device)  # [B, cap], oldest first
        full = torch.cat([ring.rows[slots, pos % cap], raw], dim=1)
        self._held[key] = torch.minimum(ring.keep[self.slots], self.start)
        n = min(S, cap)
        wpos = self.start[:, None] + torch.arange(S - n, S, device=raw.device)
        ring.rows[slots, wpos % cap] = raw[:, S - n:]
        ring.keep[self.slots] = keep_from
        return full

    def replay(self, buffer: Replay, rows: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
        raise ValueError("a fixed-shape step keeps no decoder-replay stash (decode steps never replay)")

    def raw_held_from(self, key: CacheKey) -> torch.Tensor | None:
        """[B] first position whose row the last :meth:`compressor_raw` of ``key`` returned for real."""
        return self._held.get(key)

    def append_compressed(self, key: CacheKey, new: torch.Tensor, n_new: torch.Tensor) -> None:
        """Every candidate group written (invalid ones to the scratch page): no ``nonzero``, fixed shapes."""
        rows = self._paged(key)
        epp = rows.per_page
        cnt, idx, valid = self._new_groups(rows, new, n_new)
        if new.shape[1]:
            col = (idx // epp).clamp(max=max(self.table.shape[1] - 1, 0))
            page = torch.where(valid, torch.gather(self.table, 1, col), self.cache.scratch_page)
            rows.pages[page, idx % epp] = rows.stored(new)
        rows.counts[self.slots] = cnt + n_new
        self._reads.pop(key, None)

    def _read_table(self, n: torch.Tensor, per_page: int) -> torch.Tensor:
        """The table's full width: a size the host knew before the step (no read-back of ``n``)."""
        return self.table

    def index_pages(self, key: CacheKey) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A packed index cache on the CPU as its pages, the page table's full width and the entry counts (the
        indexer scores the records where they are: ``cpu_kernels.index_topk``); None for float rows."""
        rows = self._paged(key)
        if not key.index or rows.codec.pack is None or rows.pages.device.type != "cpu":
            return None
        return rows.pages, self.table, torch.maximum(rows.counts[self.slots], rows.protected[self.slots])
