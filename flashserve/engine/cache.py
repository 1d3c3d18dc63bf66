"""The engine's V4 / V4.1 cache (docs/architecture.md#kv-cache), device side: paged global rows and slot-indexed bounded
state (:mod:`.storage`), the page table that maps each slot to its pages, and the cache's sizes.

* Global rows: every KV-source layer owns a ``main`` cache (and an ``index`` cache when indexed). One *page*
  covers ``page_tokens`` tokens of every such cache at once (``page_tokens / ratio`` entries per cache), so a
  page id names the same token range everywhere and the prefix hash chain is one hash per page of tokens.
* Bounded state: window rings, compressor partial groups, engram look-back, the decoder-replay stash.
* Storage is ``float`` (the compute dtype) or ``packed`` (the records of :mod:`.kv_codec`).

Host bookkeeping (which pages and slot a sequence holds, the prefix hash chain) belongs to the scheduler
(:mod:`.page_pool`); it tells this cache what to write through :meth:`KVCache.admit` and
:meth:`KVCache.set_pages`. :class:`~.batch_state.BatchState` is the model-facing view of it for one forward.
"""

from __future__ import annotations

import logging
import math

import torch

from ..config.model_config import ModelConfig
from .storage import CacheStorage

log = logging.getLogger("flashserve.engine")


def page_tokens_for(cfg: ModelConfig, block_size: int) -> int:
    """Tokens per page: a multiple of every compression ratio, at least ``block_size``."""
    ratios = [r for r in cfg.compress_ratios[:cfg.num_hidden_layers] if r > 0] or [1]
    lcm = 1
    for r in ratios:
        lcm = lcm * r // math.gcd(lcm, r)
    return lcm * max(1, -(-block_size // lcm))


def page_size(cfg: ModelConfig, block_size: int, packed: bool, element_bytes: int) -> tuple[int, int]:
    """(tokens, bytes) of one page across every global cache, as :class:`KVCache` lays it out (``element_bytes``:
    the float cache's dtype size; packed records are bytes). Shapes only: nothing is allocated."""
    tokens = page_tokens_for(cfg, block_size)
    probe = CacheStorage.allocate(cfg, slots=1, num_pages=0, page_tokens=tokens, packed=packed,
                                  dtype=torch.float32, device=torch.device("meta"))
    return tokens, sum(r.pages[0].numel() for r in probe.paged) * (1 if packed else element_bytes)


class KVCache:
    """Device storage of a model's cache, allocated at start-up, and the page table of every slot."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, packed: bool,
                 kv_memory: int, max_num_seqs: int, block_size: int = 64, num_pages: int | None = None,
                 spare_rows: int = 0, draft_stages: int = 0, draft_layers: int = 0):
        """``spare_rows``: the most draft tokens one verification checks (speculative decoding), kept as spare
        ring rows so a rejected draft can be rolled back (:meth:`rollback`); ``draft_stages``: DSpark stage
        windows to keep; ``draft_layers``: MTP blocks whose window rings to keep."""
        self.cfg, self.dtype, self.device, self.packed = cfg, dtype, torch.device(device), packed
        self.window_size = cfg.sliding_window
        self.page_tokens = page_tokens_for(cfg, block_size)
        self.kv_memory = kv_memory
        elt = torch.empty((), dtype=dtype).element_size()
        self.page_bytes = page_size(cfg, block_size, packed, elt)[1]
        self.num_pages = num_pages if num_pages is not None else max(1, kv_memory // max(self.page_bytes, 1))
        self.num_slots = max_num_seqs
        # one page and one slot past the scheduler's: where the rows a fixed-shape step masks out are written
        # (padding rows of a bucket, groups not completed this step) instead of branching on the host
        self.scratch_page, self.scratch_slot = self.num_pages, max_num_seqs
        self.rows = max_num_seqs + 1
        self.storage = CacheStorage.allocate(cfg, slots=self.rows, num_pages=self.num_pages,
                                             page_tokens=self.page_tokens, packed=packed, dtype=dtype,
                                             device=self.device, spare=spare_rows, draft_stages=draft_stages,
                                             draft_layers=draft_layers)
        # each slot's page ids, written once per new page, so a step's page table is one gather instead of
        # a list of every page of every row (55 us per row at 50k tokens); width doubles on demand
        self.page_table = torch.zeros(self.rows, 16, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------ sizes
    @property
    def bytes_per_token(self) -> float:
        """Measured global-cache allocation per token (page bytes / page tokens)."""
        return self.page_bytes / self.page_tokens

    def bounded_bytes_per_sequence(self) -> int:
        """Window rings of every layer + compressor partial groups + look-back (excludes the replay stash)."""
        return self.storage.bounded_bytes()

    def describe(self, context: int) -> str:
        per_seq = context * self.bytes_per_token + self.bounded_bytes_per_sequence()
        fit = int(self.kv_memory // per_seq) if per_seq else 0
        kind = "packed" if self.packed else f"float ({self.dtype})"
        return (f"kv cache: {kind}, {self.bytes_per_token:.2f} B/token global, "
                f"{self.bounded_bytes_per_sequence()} B/sequence bounded state, page = {self.page_tokens} tokens "
                f"({self.page_bytes} B), {self.num_pages} pages; {fit} sessions of {context} tokens fit in "
                f"{self.kv_memory} B")

    # ------------------------------------------------------------ what the scheduler tells the cache
    def admit(self, slot: int, pages: list[int], tokens: list[int], replay_start: int,
              cached_tokens: int) -> None:
        """A sequence of ``tokens`` takes ``slot`` with ``pages``; it resumes computing at ``replay_start`` with
        ``cached_tokens`` of global rows on shared pages."""
        n = self.storage.history.shape[1]
        self.storage.reset_slot(slot, tokens[max(0, replay_start - n):replay_start] if n else [])
        self.set_pages(slot, 0, pages)
        for rows in self.storage.paged:
            rows.counts[slot] = replay_start // rows.ratio
            rows.protected[slot] = cached_tokens // rows.ratio

    def set_pages(self, slot: int, start: int, pages: list[int]) -> None:
        """Write ``pages`` into ``slot``'s page-table row from index ``start`` (0: a new row, cleared)."""
        end = start + len(pages)
        if end > self.page_table.shape[1]:
            width = max(end, 2 * self.page_table.shape[1])
            grown = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
            grown[:, :self.page_table.shape[1]] = self.page_table
            self.page_table = grown
        row = self.page_table[slot]
        if start == 0:
            row.zero_()
        if pages:
            row[start:end] = torch.tensor(pages, dtype=torch.long) if len(pages) > 1 else pages[0]

    def rollback(self, slots: list[int], ends: list[int], histories: list[list[int]]) -> None:
        """Forget what rejected draft rows wrote: each slot returns to the state of a run that computed exactly
        positions ``[0, ends[i])`` (see :meth:`CacheStorage.rollback`)."""
        if slots:
            self.storage.rollback(slots, ends, histories)

    def drop_stash(self, slot: int) -> None:
        """The decoder-replay rows are only needed until a sequence's prefill ends."""
        self.storage.replay.drop(slot)
