"""The cache view of a fixed-shape step: every shape follows from sizes the host knows before the step, and
nothing reads a tensor value back to the host, so the step can be compiled (or captured) once per bucket.

It differs from :class:`~flashserve.engine.cache.BatchState` (the dynamic path it is tested against) in three
places, each trading a little wasted arithmetic for a fixed shape:

* compressor rings are read whole (``ratio - 1`` rows), with the first position each slot still holds
  reported through :meth:`raw_held_from` so rows not held are masked as absent;
* every group a forward *could* complete is written, the ones it did not complete to the scratch page;
* global caches are read over the page table's full width (a host-known size).
"""

from __future__ import annotations

import torch

from .cache import BatchState, KVCache


class FixedBatchState(BatchState):
    """:class:`~flashserve.model.state.SequenceState` over padded batch rows given as tensors.

    ``slots`` [B] and ``table`` [B, P] come from the step's metadata; padding rows name the cache's scratch
    slot and scratch page, so whatever they write lands where nothing reads.
    """

    fixed_shape = True

    def __init__(self, cache: KVCache, slots: torch.Tensor, table: torch.Tensor):
        self.cache = cache
        self.slots, self.table = slots, table
        self.B = slots.shape[0]
        self.start = torch.zeros(self.B, dtype=torch.long, device=slots.device)
        self.num_new = 0
        self._reads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._held: dict[str, torch.Tensor] = {}
        self._win = None

    def compressor_raw(self, key: str, raw: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        cap = cache.raw_capacity(key)
        if cap == 0:
            return raw
        if cap is None or key.startswith("decoder_replay"):
            raise ValueError(f"a fixed-shape step keeps no {key!r} buffer (decode steps never replay)")
        ring, keep = cache.raw_ring(key, cap, raw)
        S = raw.shape[1]
        slots = self.slots[:, None]
        pos = self.start[:, None] - cap + torch.arange(cap, device=raw.device)  # [B, cap], oldest first
        full = torch.cat([ring[slots, pos % cap], raw], dim=1)
        self._held[key] = torch.minimum(keep[self.slots], self.start)
        n = min(S, cap)
        wpos = self.start[:, None] + torch.arange(S - n, S, device=raw.device)
        ring[slots, wpos % cap] = raw[:, S - n:]
        keep[self.slots] = keep_from
        return full

    def raw_held_from(self, key: str) -> torch.Tensor | None:
        """[B] first position whose row the last :meth:`compressor_raw` of ``key`` returned for real."""
        return self._held.get(key)

    def append_compressed(self, key: str, new: torch.Tensor, n_new: torch.Tensor) -> None:
        """Every candidate group written (invalid ones to the scratch page): no ``nonzero``, fixed shapes."""
        cache = self.cache
        pages = cache.pages[key]
        epp = pages.shape[1]
        cnt, idx, valid = self._new_groups(key, new, n_new)
        if new.shape[1]:
            col = (idx // epp).clamp(max=max(self.table.shape[1] - 1, 0))
            page = torch.where(valid, torch.gather(self.table, 1, col), cache.scratch_page)
            pages[page, idx % epp] = self._stored(key, new)
        cache.counts[key][self.slots] = cnt + n_new
        self._reads.pop(key, None)

    def compressed(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._reads.get(key)
        if got is not None:
            return got
        cache = self.cache
        gk = cache.key_by_name[key]
        n = torch.maximum(cache.counts[key][self.slots], cache.protected[key][self.slots])
        rows = cache.pages[key][self.table].flatten(1, 2)  # [B, P*epp, width]
        if gk.codec.pack is not None:
            rows = gk.codec.unpack(rows, cache.dtype)
        self._reads[key] = (rows, n)
        return rows, n
