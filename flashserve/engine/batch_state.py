""":class:`BatchState`: the model's :class:`~flashserve.model.state.SequenceState` over the engine's cache for
one forward of a batch of sequences (prefill chunks, and decode steps run eagerly). Shapes may follow the data
here (it reads counts back to size its reads); :class:`~.fixed_state.FixedBatchState` is the fixed-shape
variant the decode step compiles, tested equal to this one.
"""

from __future__ import annotations

import torch

from ..model.state import CacheKey, Replay, gather_entries
from .cache import KVCache
from .storage import LayerStorage, PagedRows


class BatchState:
    """:class:`~flashserve.model.state.SequenceState` over a batch of engine sequences (one forward)."""

    fixed_shape = False

    def __init__(self, cache: KVCache, slots: list[int], page_tables: list[list[int]] | int):
        """``page_tables``: each row's page ids, or the width to take from ``cache.page_table`` (what
        :meth:`KVCache.set_pages` wrote for these slots)."""
        dev = cache.device
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        if isinstance(page_tables, int):
            table = cache.page_table[slot_t, :page_tables]
        else:
            width = max((len(p) for p in page_tables), default=0)
            rows = [p + [0] * (width - len(p)) for p in page_tables]
            table = torch.tensor(rows, dtype=torch.long, device=dev).view(len(slots), width)
        self._setup(cache, slot_t, table)

    def _setup(self, cache: KVCache, slots: torch.Tensor, table: torch.Tensor) -> None:
        self.cache = cache
        self.layers: list[LayerStorage] = cache.storage.layers  # the storage each layer reads and writes
        self.slots, self.table = slots, table  # [B], [B, P]
        self.B = slots.shape[0]
        self.start = torch.zeros(self.B, dtype=torch.long, device=slots.device)
        self.num_new = 0
        self._reads: dict[CacheKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self._win = None

    def begin(self, num_new: int, start: torch.Tensor | None = None) -> None:
        self._win = None
        if start is not None:
            self.start = start.to(self.cache.device)
        elif self.num_new:
            self.start = self.start + self.num_new
        self.num_new = num_new

    def _paged(self, key: CacheKey) -> PagedRows:
        return self.layers[key.layer].paged(key)

    # ------------------------------------------------------------ window rings
    def _window_index(self, keep: int, S: int, device) -> tuple:
        """Ring read / write indices and key positions, shared by every layer of one forward."""
        w = self._win
        if w is None or w[0] != (keep, S):
            ar = torch.arange(keep, device=device)
            read = self.slots[:, None], (self.start[:, None] - keep + ar) % keep
            T = keep + S
            last = self.start + self.num_new - 1
            pos = last[:, None] - torch.arange(T - 1, -1, -1, device=device)
            n = min(S, keep)
            write = self.slots[:, None], (self.start[:, None] + torch.arange(S - n, S, device=device)) % max(keep, 1)
            w = self._win = ((keep, S), read, pos, write, n)
        return w

    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        win = self.layers[layer].window
        ring, codec = win.rows, win.codec  # row of position p at p % (W-1)
        keep = ring.shape[1]
        S = kv.shape[1]
        _, read, pos, write, n = self._window_index(keep, S, kv.device)
        if keep:
            prior_raw = ring[read]
            prior = codec.unpack(prior_raw, kv.dtype) if codec.pack is not None else prior_raw
            full = torch.cat([prior.to(kv.dtype), kv], dim=1)
        else:
            full = kv
        wf = win.first[self.slots]
        wf = torch.where(wf < 0, self.start, wf)
        win.first[self.slots] = wf
        pos = torch.where(pos >= wf[:, None], pos, -1)
        if keep:
            new = kv[:, S - n:]
            ring[write] = codec.pack(new) if codec.pack is not None else new.to(ring.dtype)
        return full, pos

    # ------------------------------------------------------------ compressor partial groups / replay stash
    def compressor_raw(self, key: CacheKey, raw: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
        """Returns only the retained rows the model can ask for (positions >= the last ``keep_from``)."""
        ring = self.layers[key.layer].ring(key)
        if ring is None:  # ratio 1: every row is a whole group
            return raw
        cap, S = ring.capacity, raw.shape[1]
        K = int((self.start - ring.keep[self.slots]).clamp(0, cap).max()) if self.B else 0
        if K:
            pos = self.start[:, None] - K + torch.arange(K, device=raw.device)
            full = torch.cat([ring.rows[self.slots[:, None], pos % cap], raw], dim=1)
        else:
            full = raw
        n = min(S, cap)
        pos = self.start[:, None] + torch.arange(S - n, S, device=raw.device)
        ring.rows[self.slots[:, None], pos % cap] = raw[:, S - n:]
        ring.keep[self.slots] = keep_from
        return full

    def replay(self, buffer: Replay, rows: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
        return self.cache.storage.replay.append(buffer, self.slots.tolist(), rows)

    def raw_held_from(self, key: CacheKey) -> None:
        return None

    # ------------------------------------------------------------ global paged rows
    def _new_groups(self, rows: PagedRows, new: torch.Tensor, n_new: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entry counts [B], entry index [B, G] and validity [B, G] of the groups ``new`` [B, G, .] may append
        (the first ``n_new`` of each row, past any protected prefix entries)."""
        cnt = rows.counts[self.slots]
        g = torch.arange(new.shape[1], device=new.device)
        idx = cnt[:, None] + g[None, :]
        valid = (g[None, :] < n_new[:, None]) & (idx >= rows.protected[self.slots][:, None])
        return cnt, idx, valid

    def append_compressed(self, key: CacheKey, new: torch.Tensor, n_new: torch.Tensor) -> None:
        rows = self._paged(key)
        epp = rows.per_page
        cnt, idx, valid = self._new_groups(rows, new, n_new)
        if new.shape[1]:
            r, c = valid.nonzero(as_tuple=True)
            if r.numel():
                e = idx[r, c]
                rows.pages[self.table[r, e // epp], e % epp] = rows.stored(new[r, c])
        rows.counts[self.slots] = cnt + n_new
        self._reads.pop(key, None)

    def compressed(self, key: CacheKey) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._reads.get(key)
        if got is not None:
            return got
        rows = self._paged(key)
        n = torch.maximum(rows.counts[self.slots], rows.protected[self.slots])
        entries = rows.values(rows.pages[self._read_table(n, rows.per_page)].flatten(1, 2), self.cache.dtype)
        self._reads[key] = (entries, n)  # entries [B, T, width], T a whole number of pages
        return entries, n

    def _read_table(self, n: torch.Tensor, per_page: int) -> torch.Tensor:
        """Page-table columns a whole read covers: the pages the largest count ``n`` [B] reaches."""
        return self.table[:, :-(-(int(n.max()) if self.B else 0) // per_page)]

    def compressed_rows(self, key: CacheKey, index: torch.Tensor) -> torch.Tensor:
        """The picked entries straight from their pages: a decode step of sparse attention reads (and
        unpacks) k rows per query, not the sequence's whole compressed cache."""
        if key in self._reads or index.numel() == 0:  # already read whole this forward (or nothing to read)
            return gather_entries(self.compressed(key)[0], index)
        rows = self._paged(key)
        epp = rows.per_page
        page = torch.gather(self.table, 1, (index // epp).flatten(1)).view_as(index)
        return rows.values(rows.pages[page, index % epp], self.cache.dtype)  # [B,S,k,width]

    def index_pages(self, key: CacheKey) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """None: the dynamic path keeps the torch code of the indexer (the reference the fixed-shape step's
        kernel is tested against)."""
        return None

    # ------------------------------------------------------------ engram look-back
    def history(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        buf = self.cache.storage.history
        if n == 0:
            return ids
        prior = buf[self.slots][:, -n:]
        full = torch.cat([prior, ids], dim=1)
        buf[self.slots] = full[:, -buf.shape[1]:]
        return full
