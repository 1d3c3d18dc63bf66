"""vLLM-v1-style scheduler: every step gives each running sequence a number of tokens to compute within a
token budget (decode = 1, prefill = a chunk), admits waiting sequences while budget, slots and pages allow,
preempts by recompute when pages run out, and owns the host bookkeeping of the cache: its page pool, prefix
hash chain and slots (the cache holds only device storage and writes what the scheduler tells it)."""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

from .cache import KVCache
from .page_pool import PagePool, chain_hash
from .sequence import Sequence, Status

log = logging.getLogger("flashserve.engine")


@dataclass
class SchedulerOutput:
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # cannot fit even alone: finished with "length"

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.failed


class Scheduler:
    def __init__(self, cache: KVCache, *, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk: int | None, enable_prefix_caching: bool, num_layers: int, is_v41: bool,
                 encoder_layers: int | None = None, prefix_replay: str = "exact"):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running sequence needs a token each step")
        self.cache = cache
        self.pool = PagePool(cache.num_pages)
        self.free_slots = list(range(cache.num_slots - 1, -1, -1))
        self.P = cache.page_tokens
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk or max_num_batched_tokens
        self.prefix = enable_prefix_caching
        self.num_layers = num_layers
        self.is_v41 = is_v41
        self.encoder_layers = encoder_layers if encoder_layers is not None else num_layers
        if prefix_replay not in ("exact", "window"):
            raise ValueError(f"prefix_replay must be 'exact' or 'window', got {prefix_replay!r}")
        self.prefix_replay = prefix_replay
        ratios = [r for r in cache.cfg.compress_ratios[:num_layers] if r > 0] or [1]
        self.align = 1  # replay starts on a multiple of every compression ratio (no partial group to rebuild)
        for r in ratios:
            self.align = self.align * r // math.gcd(self.align, r)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ pages
    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.P)

    def replay_start(self, cached: int, exact: bool) -> int:
        """Where a sequence with ``cached`` tokens of global rows restarts computing (prefix replay,
        docs/architecture.md#encoder-decoder-and-bounded-replay). Window state at a position depends on
        ``depth·(window−1)`` earlier rows through ``depth`` stacked windowed layers, so replaying that far rebuilds
        exactly what a cold run holds: depth = all layers for exact prefill, the encoder's layers for encoder-only
        prefill (whose decoder only ever sees the bounded replay segment). ``prefix_replay="window"`` uses the serving stacks'
        cheaper approximate rule (back by one window)."""
        if cached == 0:
            return 0
        W = self.cache.window_size
        if self.prefix_replay == "window":
            back = W
        else:
            back = (self.num_layers if exact else self.encoder_layers) * (W - 1)
            back = max(back, W)  # the decoder replay segment must lie inside the recomputed rows
        r = max(0, cached - back)
        return (r // self.align) * self.align

    def _lookup(self, seq: Sequence) -> list[int]:
        """Pages of the longest cached prefix of ``seq`` (leaving at least one token to compute)."""
        if not self.prefix or seq.group.params.prompt_logprobs is not None:
            return []
        hits, h = [], None
        limit = (seq.num_tokens - 1) // self.P
        hashes = []
        for i in range(limit):
            lo, hi = i * self.P, (i + 1) * self.P
            h = chain_hash(h, seq.tokens[lo:hi], seq.group.page_salt(lo, hi))
            page = self.pool.lookup(h)
            if page is None:
                break
            hits.append(page)
            hashes.append(h)
        seq._hit_hashes = hashes
        return hits

    def register(self, seq: Sequence) -> None:
        """Publish the full pages ``seq`` has computed in the prefix hash chain."""
        if not self.prefix or seq.group.params.prompt_logprobs is not None:
            return
        full = min(seq.num_computed // self.P, len(seq.pages))
        while len(seq.page_hashes) < full:
            i = len(seq.page_hashes)
            parent = seq.page_hashes[-1] if seq.page_hashes else None
            lo, hi = i * self.P, (i + 1) * self.P
            h = chain_hash(parent, seq.tokens[lo:hi], seq.group.page_salt(lo, hi))
            self.pool.register(seq.pages[i], h)
            seq.page_hashes.append(h)

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens to compute for ``seq`` from ``start``: the rest (decode: 1), a prefill chunk at most, within
        the budget; a V4.1 encoder-only prefill stops at the prompt's end (its decoder replays there)."""
        n = seq.num_tokens - start
        if not seq.prefill_done:
            n = min(n, self.prefill_chunk)
            if self.is_v41 and not seq.exact and start < seq.num_prompt:
                n = min(n, seq.num_prompt - start)
        elif seq.draft:  # drafted tokens are verified within the budget too (what does not fit is dropped)
            del seq.draft[max(budget - n, 0):]
            n += len(seq.draft)
        return min(n, budget)

    def _free(self, seq: Sequence) -> None:
        for p in reversed(seq.pages):
            self.pool.release(p)
        seq.pages = []
        seq.page_hashes = []
        if seq.slot is not None:
            self.cache.drop_stash(seq.slot)
            self.free_slots.append(seq.slot)
            seq.slot = None

    def trim_pages(self, seq: Sequence) -> None:
        """Release the pages past what ``seq``'s tokens need (a verification took pages for drafts it rejected)."""
        keep = self._pages_for(seq.num_tokens)
        while len(seq.pages) > keep:
            self.pool.release(seq.pages.pop())

    def _preempt(self, seq: Sequence) -> None:
        seq.draft.clear()
        self._free(seq)
        seq.num_computed = 0
        seq.num_cached = 0
        seq.prefill_done = False
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.debug("preempted %s (recompute)", seq.seq_id)

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's pages and slot at once."""
        self._free(seq)
        if seq in self.running:
            self.running.remove(seq)
        try:
            self.waiting.remove(seq)
        except ValueError:
            pass
        seq.status = Status.FINISHED

    # ------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget
        i = 0
        decoding = sum(1 for s in self.running if s.prefill_done)  # each keeps one token of budget (not drafts)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.prefill_done:
                decoding -= 1
            n = self._chunk(seq, seq.num_computed, max(budget - decoding, 1) if seq.prefill_done else budget)
            if self._pages_for(seq.num_computed + n) > self.pool.num_pages:
                self.running.pop(i)  # grew past the whole cache: stop it rather than preempt forever
                out.failed.append(seq)
                continue
            victim = None
            while self._pages_for(seq.num_computed + n) - len(seq.pages) > self.pool.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if victim is seq:
                break
            have = len(seq.pages)
            for _ in range(self._pages_for(seq.num_computed + n) - have):
                seq.pages.append(self.pool.allocate())
            if len(seq.pages) > have:
                self.cache.set_pages(seq.slot, have, seq.pages[have:])
            out.chunks.append((seq, n))
            budget -= n
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.free_slots:
            seq = self.waiting[0]
            hits = self._lookup(seq)
            cached = len(hits) * self.P
            start = self.replay_start(cached, seq.exact)
            n = self._chunk(seq, start, budget)
            need = max(0, self._pages_for(start + n) - len(hits))
            reuse_free = sum(1 for p in hits if self.pool.ref[p] == 0)
            if need + reuse_free > self.pool.num_free:
                if self._pages_for(seq.num_tokens) > self.pool.num_pages:
                    self.waiting.popleft()  # grew past the whole cache: stop it rather than loop
                    out.failed.append(seq)
                    continue
                break
            self.waiting.popleft()
            for p in hits:
                self.pool.touch(p)
            seq.pages = list(hits)
            seq.page_hashes = list(getattr(seq, "_hit_hashes", []))
            for _ in range(need):
                seq.pages.append(self.pool.allocate())
            seq.slot = self.free_slots.pop()
            self.cache.admit(seq.slot, seq.pages, seq.tokens, start, cached)
            seq.num_computed = start
            seq.num_cached = cached
            seq.status = Status.RUNNING
            if seq.num_preemptions == 0:
                self.prefix_query_tokens += seq.num_prompt
                self.prefix_hit_tokens += cached
            self.running.append(seq)
            out.chunks.append((seq, n))
            budget -= n
        return out
