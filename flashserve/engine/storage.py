"""The cache's device storage, typed per layer and allocated once at start-up (docs/architecture.md#kv-cache).

Every tensor a step reads or writes exists before the first request, at a fixed address, so a compiled step
(or a captured CUDA graph) can hold on to it. Storage rows are slots: ``max_num_seqs`` sequences plus one
scratch slot, where padding rows of a fixed-shape step write; pages likewise have one scratch page past the
pool's. Which slot and pages a sequence owns is the scheduler's business (:mod:`.page_pool`); this module only
holds the rows.

* :class:`PagedRows`: one global compressed cache (a KV source's ``main`` or ``index`` rows), paged.
* :class:`PartialRing`: a compressor's rows of groups not yet complete, per slot.
* :class:`WindowRing`: a layer's last ``window - 1`` KV rows, per slot.
* :class:`LayerStorage`: all of the above for one layer; :class:`ReplayStash`: the decoder-replay buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config.model_config import ModelConfig
from ..model.state import CacheKey, Replay
from .kv_codec import Codec, codecs

NO_ROWS = 1 << 62  # a ring's "first position held" when it holds nothing


@dataclass
class PagedRows:
    """One global compressed cache: a slot's entry ``e`` lives at ``pages[table[e // per_page], e % per_page]``."""

    key: CacheKey
    ratio: int
    codec: Codec
    pages: torch.Tensor  # [num_pages + 1, page_tokens // ratio, width] (the last page: scratch)
    counts: torch.Tensor  # [slots] entries each slot has
    protected: torch.Tensor  # [slots] leading entries on shared prefix pages (never rewritten)

    @property
    def per_page(self) -> int:
        return self.pages.shape[1]

    def stored(self, vals: torch.Tensor) -> torch.Tensor:
        """``vals`` as the pages hold them: packed records, or the cache's dtype."""
        return self.codec.pack(vals) if self.codec.pack is not None else vals.to(self.pages.dtype)

    def values(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored ``rows`` back as values."""
        return self.codec.unpack(rows, dtype) if self.codec.pack is not None else rows


@dataclass
class PartialRing:
    """A compressor's raw rows of partial groups: a slot's row of position ``p`` at ``rows[slot, p % capacity]``."""

    rows: torch.Tensor  # [slots, capacity, width], fp32 (fp64 for a float64 model)
    keep: torch.Tensor  # [slots] first position each slot still holds (NO_ROWS: none)
    ratio: int = 1
    overlap: bool = False  # V4 CSA: the group before the current one is kept too

    def keep_from(self, end: int) -> int:
        """The first position held once a sequence has computed positions ``[0, end)`` (the compressor's rule)."""
        return max(end // self.ratio - (1 if self.overlap else 0), 0) * self.ratio

    @property
    def capacity(self) -> int:
        return self.rows.shape[1]


@dataclass
class WindowRing:
    """A layer's last ``window - 1`` KV rows (plus spare rows under speculative decoding): a slot's row of
    position ``p`` at ``rows[slot, p % capacity]``."""

    codec: Codec
    rows: torch.Tensor  # [slots, window - 1, width] (packed bytes or values)
    first: torch.Tensor  # [slots] first position the slot wrote (−1: none yet)


@dataclass
class LayerStorage:
    """What one layer keeps between steps: its window ring, and on a KV source the global caches it writes and
    the partial-group rings of the compressors that write them."""

    window: WindowRing
    main: PagedRows | None = None
    index: PagedRows | None = None
    main_ring: PartialRing | None = None
    index_ring: PartialRing | None = None

    def paged(self, key: CacheKey) -> PagedRows:
        rows = self.index if key.index else self.main
        if rows is None:
            raise KeyError(f"layer {key.layer} keeps no global cache {key}")
        return rows

    def ring(self, key: CacheKey) -> PartialRing | None:
        """None: the compressor of ``key`` keeps no partial groups (ratio 1)."""
        return self.index_ring if key.index else self.main_ring


@dataclass
class ReplayStash:
    """The decoder-replay buffers (V4.1 encoder-only prefill): the last ``capacity`` positions' inputs to the
    decoder, per prefilling slot, kept across prefill chunks and dropped when the prefill ends. Wide (the
    residual streams) and needed by few sequences at once, so kept per slot rather than in a slab."""

    capacity: int
    rows: dict[tuple[Replay, int], torch.Tensor] = field(default_factory=dict)

    def append(self, buffer: Replay, slots: list[int], new: torch.Tensor) -> torch.Tensor:
        """Prior rows ++ ``new`` [B,S,c] for each slot; keeps the last ``capacity`` of them."""
        empty = new.new_zeros(self.capacity, new.shape[-1])
        prior = torch.stack([self.rows.get((buffer, s), empty) for s in slots])
        full = torch.cat([prior.to(new.dtype), new], dim=1)
        for i, s in enumerate(slots):
            self.rows[(buffer, s)] = full[i, -self.capacity:].clone()
        return full

    def drop(self, slot: int) -> None:
        for key in [k for k in self.rows if k[1] == slot]:
            del self.rows[key]


def ring_capacity(cfg: ModelConfig, layer: int, spare: int = 0) -> int:
    """Raw rows a compressor of ``layer`` must keep: ratio − 1 (2·ratio − 1 for V4's overlapping CSA), plus
    ``spare`` (see :meth:`CacheStorage.allocate`)."""
    ratio = cfg.compress_ratios[layer]
    overlap = (not cfg.is_v41) and ratio == cfg.compress_rate_csa
    return ((2 * ratio - 1) if overlap else ratio - 1) + spare


@dataclass
class CacheStorage:
    """Every layer's storage, the replay stash and the engram look-back, for ``slots`` storage rows."""

    layers: list[LayerStorage]
    replay: ReplayStash
    history: torch.Tensor  # [slots, engram_max_ngram_size - 1] token ids before each slot's next row (−1: none)
    # DSpark's stage windows: keys of the last ``window`` verified positions for each stage, a slot's row of
    # position p at ``draft_keys[slot, p % window]`` (written after verification, so never rolled back)
    draft_keys: torch.Tensor | None = None  # [slots, window, stages, head_dim]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a step may write: what a CUDA graph must find at the same address on every replay."""
        out = [self.history] + ([self.draft_keys] if self.draft_keys is not None else [])
        for lay in self.layers:
            out += [lay.window.rows, lay.window.first]
        for rows in self.paged:
            out += [rows.pages, rows.counts, rows.protected]
        for ring in self.rings:
            out += [ring.rows, ring.keep]
        return out

    @property
    def paged(self) -> list[PagedRows]:
        """Every global cache, in layer order (main before index)."""
        return [r for lay in self.layers for r in (lay.main, lay.index) if r is not None]

    @property
    def rings(self) -> list[PartialRing]:
        return [r for lay in self.layers for r in (lay.main_ring, lay.index_ring) if r is not None]

    def reset_slot(self, slot: int, history: list[int]) -> None:
        """A slot taken by a new sequence: nothing in its rings; ``history``: the token ids before its first row
        (oldest first; only the last ``engram_max_ngram_size - 1`` are kept)."""
        for lay in self.layers:
            lay.window.first[slot] = -1
        for ring in self.rings:
            ring.keep[slot] = NO_ROWS
            ring.rows[slot] = 0
        for rows in self.paged:
            rows.counts[slot] = 0
            rows.protected[slot] = 0
        n = self.history.shape[1]
        if n:
            self.history[slot] = torch.tensor(([-1] * n + history[-n:])[-n:], dtype=torch.long)
        self.replay.drop(slot)

    def rollback(self, slots: list[int], ends: list[int], histories: list[list[int]]) -> None:
        """Forget every row at positions ``>= ends[i]`` of ``slots[i]`` (rows a rejected draft wrote): global
        entry counts, the first position each partial-group ring holds and the engram look-back return to what
        a run that computed exactly ``[0, end)`` holds (``histories[i]``: the token ids before ``end``). Ring
        rows themselves need no restoring: with ``spare`` rows (:meth:`allocate`) a verification's writes past
        ``end`` land on rows no later read takes for a position it needs."""
        dev = self.history.device
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        end_t = torch.tensor(ends, dtype=torch.long, device=dev)
        for rows in self.paged:
            rows.counts[slot_t] = end_t // rows.ratio
        for ring in self.rings:
            ring.keep[slot_t] = torch.tensor([ring.keep_from(e) for e in ends], dtype=torch.long, device=dev)
        n = self.history.shape[1]
        if n:
            self.history[slot_t] = torch.tensor([([-1] * n + h[-n:])[-n:] for h in histories], dtype=torch.long,
                                                device=dev)

    @classmethod
    def allocate(cls, cfg: ModelConfig, *, slots: int, num_pages: int, page_tokens: int, packed: bool,
                 dtype: torch.dtype, device: torch.device, spare: int = 0, draft_stages: int = 0,
                 draft_layers: int = 0) -> CacheStorage:
        """All storage of a model's cache: ``num_pages`` (+ scratch) pages, ``slots`` rows of bounded state.

        ``spare``: extra rows in every window and partial-group ring, the most draft rows one verification
        may write past the positions it keeps (speculative decoding). A ring of ``c`` needed rows plus ``k``
        spare ones never lets a write at a rejected position ``p + j`` (j <= k) land on a row still needed,
        and a stale row left there reads back as a position older than any window or group needs.
        ``draft_stages``: DSpark stages whose stage windows to keep (:attr:`draft_keys`); ``draft_layers``: V4 MTP
        blocks, whose window rings follow the backbone's (layer ``num_hidden_layers + s``)."""
        cod = codecs(cfg, packed, device)
        page_dtype = torch.uint8 if packed else dtype
        raw_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # compressors run in fp32

        def counter(fill: int = 0) -> torch.Tensor:
            return torch.full((slots,), fill, dtype=torch.long, device=device)

        def paged(key: CacheKey, ratio: int, codec: Codec) -> PagedRows:
            pages = torch.zeros(num_pages + 1, page_tokens // ratio, codec.width, dtype=page_dtype, device=device)
            return PagedRows(key, ratio, codec, pages, counter(), counter())

        def ring(layer: int, width: int) -> PartialRing:
            rows = torch.zeros(slots, ring_capacity(cfg, layer, spare), width, dtype=raw_dtype, device=device)
            ratio = cfg.compress_ratios[layer]
            return PartialRing(rows, counter(NO_ROWS), ratio, (not cfg.is_v41) and ratio == cfg.compress_rate_csa)

        layers = []
        wc = cod["window"]
        for layer, ratio in enumerate(cfg.compress_ratios[:cfg.num_hidden_layers]):
            win_rows = torch.zeros(slots, max(cfg.sliding_window - 1, 0) + spare, wc.width, dtype=page_dtype,
                                   device=device)
            lay = LayerStorage(WindowRing(wc, win_rows, counter(-1)))
            if ratio > 0 and cfg.kv_source(layer) == layer:
                lay.main = paged(CacheKey(layer), ratio, cod["main"])
                overlap = (not cfg.is_v41) and ratio == cfg.compress_rate_csa
                if cfg.is_v41 or overlap:
                    lay.index = paged(CacheKey(layer, index=True), ratio, cod["index"])
                if ratio > 1:
                    lay.main_ring = ring(layer, (4 if overlap else 2) * cfg.head_dim)
                if overlap:
                    lay.index_ring = ring(layer, 4 * cfg.index_head_dim)
            layers.append(lay)
        for _ in range(draft_layers):
            rows = torch.zeros(slots, max(cfg.sliding_window - 1, 0) + spare, wc.width, dtype=page_dtype, device=device)
            layers.append(LayerStorage(WindowRing(wc, rows, counter(-1))))
        n_hist = max(cfg.engram_max_ngram_size - 1, 0) if cfg.engram_layer_ids else 0
        history = torch.full((slots, n_hist), -1, dtype=torch.long, device=device)
        draft = (torch.zeros(slots, cfg.sliding_window, draft_stages, cfg.head_dim, dtype=dtype, device=device)
                 if draft_stages else None)
        return cls(layers, ReplayStash(cfg.sliding_window), history, draft)

    def bounded_bytes(self) -> int:
        """Bytes of one slot's bounded state: window rings, partial-group rings and look-back (the replay stash
        exists only while a sequence prefills)."""
        total = sum(lay.window.rows[0].numel() * lay.window.rows.element_size() for lay in self.layers)
        total += sum(r.rows[0].numel() * 4 for r in self.rings)  # fp32 rows (fp64 models: counted as fp32)
        return total + self.history.shape[1] * 8
