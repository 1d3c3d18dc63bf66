"""The engine's V4 / V4.1 cache (spec §3): paged global rows shared through a prefix hash chain, and bounded
per-sequence state (window rings, compressor partial groups, engram look-back, decoder-replay stash) in
slot-indexed slabs.

* Global rows: every KV-source layer owns a ``main`` cache (and an ``index`` cache when indexed). One *page*
  covers ``page_tokens`` tokens of every such cache at once (``page_tokens / ratio`` entries per cache), so a
  page id names the same token range everywhere and the prefix hash chain is one hash per page of tokens.
* Bounded state: each running sequence holds a slot; slabs are ``[num_slots, capacity, width]``, right-aligned
  (the last row of a slot is the newest position), matching :class:`flashserve.model.state.SequenceState`.
* Storage is ``float`` (the compute dtype) or ``packed`` (V4.1: FP4-E4M3 main rows, FP4-UE8M0 index rows,
  FP8-UE8M0 window rows; V4: FP8 rows with bf16 RoPE dims and FP4 index rows — the records of
  :func:`flashserve.config.arithmetic.kv_record`).

:class:`BatchState` is the model-facing view of a batch of sequences for one forward.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from ..config.arithmetic import kv_record
from ..config.model_config import ModelConfig
from ..model import quant
from ..model.state import gather_entries

log = logging.getLogger("flashserve.engine")

E4M3_MAX = 448.0
NO_ROWS = 1 << 62


# --------------------------------------------------------------------------- packed records
def _pack_v4_fp8(x: torch.Tensor, rope: int, width: int) -> torch.Tensor:
    """V4 record: FP8-E4M3 no-RoPE dims with one UE8M0 scale per 64, bf16 RoPE dims, zero pad to ``width``."""
    nope = x[..., : x.shape[-1] - rope].float()
    d = nope.shape[-1]
    nb = -(-d // 64)
    padded = torch.nn.functional.pad(nope, (0, nb * 64 - d)).unflatten(-1, (nb, 64))
    amax = padded.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    exp = torch.ceil(torch.log2(amax / E4M3_MAX))
    q = (padded / torch.exp2(exp)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.flatten(-2)[..., :d].view(torch.uint8)
    r = x[..., x.shape[-1] - rope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    sc = (exp.squeeze(-1) + 127).to(torch.uint8)
    out = torch.cat([q, r, sc], dim=-1)
    return torch.nn.functional.pad(out, (0, width - out.shape[-1]))


def _unpack_v4_fp8(p: torch.Tensor, dim: int, rope: int, dtype: torch.dtype) -> torch.Tensor:
    d = dim - rope
    nb = -(-d // 64)
    q = p[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    r = p[..., d:d + 2 * rope].contiguous().view(torch.bfloat16).float()
    exp = p[..., d + 2 * rope:d + 2 * rope + nb].float() - 127
    scale = torch.exp2(exp).repeat_interleave(64, dim=-1)[..., :d]
    return torch.cat([q * scale, r], dim=-1).to(dtype)


def _fp4_pairs() -> torch.Tensor:
    """[256, 2] float32: the two E2M1 values (low nibble first) of every byte."""
    b = torch.arange(256, dtype=torch.uint8)
    return torch.stack([quant.e2m1_decode(b & 15), quant.e2m1_decode(b >> 4)], dim=-1)


def _unpack_fp4(p: torch.Tensor, block: int, e4m3: bool, dtype: torch.dtype, pairs: torch.Tensor) -> torch.Tensor:
    """Table-driven inverse of ``pack_fp4_e4m3`` (``e4m3``) / ``pack_fp4_ue8m0``: same values, fewer ops.
    ``pairs``: :func:`_fp4_pairs` on ``p``'s device."""
    d = p.shape[-1] * 2 * block // (block + 2)  # record = d/2 code bytes + d/block scale bytes
    vals = pairs[p[..., : d // 2].long()].flatten(-2)  # [..., d]
    sc = p[..., d // 2:]
    scale = sc.contiguous().view(torch.float8_e4m3fn).float() if e4m3 else quant.e8m0_to_float(sc)
    return (vals.unflatten(-1, (-1, block)) * scale[..., None]).flatten(-2).to(dtype)


def _unpack_fp8(p: torch.Tensor, dtype: torch.dtype, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp8_ue8m0`` (E4M3 bytes + one UE8M0 scale per 32); ``scales``: the 256 UE8M0 values
    on ``p``'s device."""
    d = p.shape[-1] * 32 // 33
    q = p[..., :d].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return (q.unflatten(-1, (-1, 32)) * scales[p[..., d:].long()][..., None]).flatten(-2).to(dtype)


@dataclass
class Codec:
    """How one kind of row is stored: ``width`` bytes (packed) or values (float)."""

    width: int
    pack: Callable[[torch.Tensor], torch.Tensor] | None  # None = float storage
    unpack: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None


def codecs(cfg: ModelConfig, packed: bool, device: torch.device | str = "cpu") -> dict[str, Codec]:
    """Codecs of the ``main``, ``index`` and ``window`` rows; their decode tables live on ``device``, made
    once here (no table is created or looked up while a step runs)."""
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    if not packed:
        return {"main": Codec(hd, None, None), "index": Codec(ihd, None, None), "window": Codec(hd, None, None)}
    rec = kv_record(cfg)
    pairs = _fp4_pairs().to(device)
    scales = quant.e8m0_to_float(torch.arange(256, dtype=torch.uint8)).to(device)
    index = Codec(rec.index, quant.pack_fp4_ue8m0, lambda p, dt: _unpack_fp4(p, 32, False, dt, pairs))
    if cfg.is_v41:
        return {"main": Codec(rec.main, quant.pack_fp4_e4m3, lambda p, dt: _unpack_fp4(p, 16, True, dt, pairs)),
                "index": index,
                "window": Codec(rec.window, quant.pack_fp8_ue8m0, lambda p, dt: _unpack_fp8(p, dt, scales))}
    rope = cfg.qk_rope_head_dim
    v4 = Codec(rec.main, lambda x: _pack_v4_fp8(x, rope, rec.main),
               lambda p, dt: _unpack_v4_fp8(p, hd, rope, dt))
    return {"main": v4, "index": index, "window": v4}


@dataclass
class GlobalKey:
    name: str  # "<layer>.main" / "<layer>.index" (the model's cache keys)
    layer: int
    ratio: int
    dim: int
    codec: Codec


def global_keys(cfg: ModelConfig, packed: bool, device: torch.device | str = "cpu") -> list[GlobalKey]:
    """Every global (compressed) cache the model writes, in layer order."""
    cod = codecs(cfg, packed, device)
    keys = []
    for layer, ratio in enumerate(cfg.compress_ratios[:cfg.num_hidden_layers]):
        if ratio == 0 or cfg.kv_source(layer) != layer:
            continue
        keys.append(GlobalKey(f"{layer}.main", layer, ratio, cfg.head_dim, cod["main"]))
        if cfg.is_v41 or ratio == cfg.compress_rate_csa:
            keys.append(GlobalKey(f"{layer}.index", layer, ratio, cfg.index_head_dim, cod["index"]))
    return keys


def ring_widths(cfg: ModelConfig) -> dict[str, int]:
    """Row width (fp32 values) of every compressor's partial-group ring: values and gates, twice as wide
    for V4's overlapping CSA compressors; ratio 1 keeps no ring."""
    widths = {}
    for layer, ratio in enumerate(cfg.compress_ratios[:cfg.num_hidden_layers]):
        if ratio <= 1 or cfg.kv_source(layer) != layer:
            continue
        overlap = (not cfg.is_v41) and ratio == cfg.compress_rate_csa
        widths[f"{layer}.main"] = (4 if overlap else 2) * cfg.head_dim
        if overlap:
            widths[f"{layer}.index"] = 4 * cfg.index_head_dim
    return widths


def page_tokens_for(cfg: ModelConfig, block_size: int) -> int:
    """Tokens per page: a multiple of every compression ratio, at least ``block_size``."""
    ratios = [r for r in cfg.compress_ratios[:cfg.num_hidden_layers] if r > 0] or [1]
    lcm = 1
    for r in ratios:
        lcm = lcm * r // math.gcd(lcm, r)
    return lcm * max(1, -(-block_size // lcm))


def parse_bytes(value: str | int) -> int:
    """``"1GiB"``, ``"512MB"``, ``"300k"`` or an int → bytes."""
    if isinstance(value, int):
        return value
    s = str(value).strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10 ** 3, "mb": 10 ** 6,
             "gb": 10 ** 9, "tb": 10 ** 12, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            return int(float(s[: -len(u)]) * units[u])
    return int(float(s))


# --------------------------------------------------------------------------- page pool + prefix hash chain
class PagePool:
    """Reference-counted pages; freed pages that hold a hashed full page stay findable until reused (LRU)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.hash_of: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def allocate(self) -> int:
        page, _ = self.free.popitem(last=False)
        h = self.hash_of[page]
        if h is not None:
            if self.cached.get(h) == page:
                del self.cached[h]
            self.hash_of[page] = None
        self.ref[page] = 1
        return page

    def touch(self, page: int) -> None:
        if self.ref[page] == 0:
            del self.free[page]
        self.ref[page] += 1

    def release(self, page: int) -> None:
        self.ref[page] -= 1
        assert self.ref[page] >= 0, page
        if self.ref[page] == 0:
            self.free[page] = None
            if self.hash_of[page] is None:  # nothing worth keeping: reuse first
                self.free.move_to_end(page, last=False)

    def register(self, page: int, h: bytes) -> None:
        if h in self.cached or self.hash_of[page] is not None:
            return
        self.hash_of[page] = h
        self.cached[h] = page

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)


def chain_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    m = hashlib.blake2b(digest_size=16)
    m.update(parent or b"root")
    m.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return m.digest()


# --------------------------------------------------------------------------- the cache
class KVCache:
    """Pages of global rows, slabs of bounded per-sequence state, and the accounting around them."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, packed: bool,
                 kv_memory: int, max_num_seqs: int, block_size: int = 64, num_pages: int | None = None):
        self.cfg, self.dtype, self.device, self.packed = cfg, dtype, torch.device(device), packed
        self.window_size = cfg.sliding_window
        self.page_tokens = page_tokens_for(cfg, block_size)
        self.keys = global_keys(cfg, packed, self.device)
        self.window_codec = codecs(cfg, packed, self.device)["window"]
        elt = torch.empty((), dtype=dtype).element_size()
        self.page_bytes = sum((self.page_tokens // k.ratio) * k.codec.width * (1 if packed else elt)
                              for k in self.keys)
        if num_pages is None:
            num_pages = max(1, kv_memory // max(self.page_bytes, 1))
        self.num_pages = num_pages
        self.pool = PagePool(num_pages)
        # one page and one slot past the pool's: where the rows a fixed-shape step masks out are written
        # (padding rows of a bucket, groups not completed this step) instead of branching on the host
        self.scratch_page, self.scratch_slot = num_pages, max_num_seqs
        self.pages: dict[str, torch.Tensor] = {}
        for k in self.keys:
            shape = (num_pages + 1, self.page_tokens // k.ratio, k.codec.width)
            self.pages[k.name] = torch.zeros(shape, dtype=torch.uint8 if packed else dtype, device=self.device)
        self.key_by_name = {k.name: k for k in self.keys}
        # bounded per-sequence state
        self.num_slots = max_num_seqs
        self.rows = max_num_seqs + 1  # storage rows per slab: the sequences' slots and the scratch slot
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.counts = {k.name: torch.zeros(self.rows, dtype=torch.long, device=self.device)
                       for k in self.keys}
        self.protected = {k.name: torch.zeros(self.rows, dtype=torch.long, device=self.device)
                          for k in self.keys}
        self.windows: dict[int, torch.Tensor] = {}
        self.window_from: dict[int, torch.Tensor] = {}
        self.raw: dict[str, torch.Tensor] = {}
        self.raw_keep: dict[str, torch.Tensor] = {}  # first position each slot's ring still holds
        # (replay buffer key, slot) -> decoder-replay rows (only while the sequence prefills)
        self.stash: dict[tuple[str, int], torch.Tensor] = {}
        n_hist = max(cfg.engram_max_ngram_size - 1, 0) if cfg.engram_layer_ids else 0
        self.history = torch.full((self.rows, n_hist), -1, dtype=torch.long, device=self.device)
        self.kv_memory = kv_memory
        # each slot's page ids, written once per new page, so a step's page table is one gather instead of
        # a list of every page of every row (55 us per row at 50k tokens); width doubles on demand
        self.page_table = torch.zeros(self.rows, 16, dtype=torch.long, device=self.device)
        self._allocate_state()

    def _allocate_state(self) -> None:
        """Window rings of every layer and compressor partial-group rings of every KV source, allocated once
        at start-up so that a step never creates storage (what lets a compiled step hold on to them)."""
        cfg = self.cfg
        for layer in range(cfg.num_hidden_layers):
            self.window_slab(layer, torch.empty(0, cfg.head_dim, dtype=self.dtype))
        raw_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32  # compressors run in fp32
        for key, width in ring_widths(cfg).items():
            self.raw_ring(key, self.raw_capacity(key), torch.empty(0, width, dtype=raw_dtype))

    # ------------------------------------------------------------ sizes
    @property
    def bytes_per_token(self) -> float:
        """Measured global-cache allocation per token (page bytes / page tokens)."""
        return self.page_bytes / self.page_tokens

    def bounded_bytes_per_sequence(self) -> int:
        """Window rings of every layer + compressor partial groups + look-back (excludes the replay stash)."""
        cfg, W = self.cfg, self.window_size
        elt = torch.empty((), dtype=self.dtype).element_size()
        win = cfg.num_hidden_layers * (W - 1) * self.window_codec.width * (1 if self.packed else elt)
        comp = 0
        for layer, ratio in enumerate(cfg.compress_ratios[:cfg.num_hidden_layers]):
            if ratio == 0 or cfg.kv_source(layer) != layer:
                continue
            overlap = (not cfg.is_v41) and ratio == cfg.compress_rate_csa
            rows = (2 * ratio - 1) if overlap else ratio - 1
            width = (4 if overlap else 2) * cfg.head_dim if ratio > 1 else cfg.head_dim
            comp += rows * width * 4
            if overlap:
                comp += rows * 4 * cfg.index_head_dim * 4
        return win + comp + self.history.shape[1] * 8

    def describe(self, context: int) -> str:
        per_seq = context * self.bytes_per_token + self.bounded_bytes_per_sequence()
        fit = int(self.kv_memory // per_seq) if per_seq else 0
        kind = "packed" if self.packed else f"float ({self.dtype})"
        return (f"kv cache: {kind}, {self.bytes_per_token:.2f} B/token global, "
                f"{self.bounded_bytes_per_sequence()} B/sequence bounded state, page = {self.page_tokens} tokens "
                f"({self.page_bytes} B), {self.num_pages} pages; {fit} sessions of {context} tokens fit in "
                f"{self.kv_memory} B")

    # ------------------------------------------------------------ slots
    def acquire_slot(self, history: list[int] | None = None) -> int:
        slot = self.free_slots.pop()
        for t in self.window_from.values():
            t[slot] = -1
        for t in self.raw.values():
            t[slot] = 0
        for t in self.raw_keep.values():
            t[slot] = NO_ROWS
        for d in (self.counts, self.protected):
            for t in d.values():
                t[slot] = 0
        n = self.history.shape[1]
        if n:
            h = ([-1] * n + list(history or []))[-n:]
            self.history[slot] = torch.tensor(h, dtype=torch.long)
        return slot

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

    def release_slot(self, slot: int) -> None:
        self.drop_stash(slot)
        self.free_slots.append(slot)

    def drop_stash(self, slot: int) -> None:
        """The decoder-replay rows are only needed until a sequence's prefill ends."""
        for key in [k for k in self.stash if k[1] == slot]:
            del self.stash[key]

    def set_resume(self, slot: int, replay_start: int, cached_tokens: int) -> None:
        """A sequence resumes computing at ``replay_start`` with ``cached_tokens`` of global rows cached."""
        for k in self.keys:
            self.counts[k.name][slot] = replay_start // k.ratio
            self.protected[k.name][slot] = cached_tokens // k.ratio

    # ------------------------------------------------------------ slabs
    def window_slab(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        slab = self.windows.get(layer)
        if slab is None:
            c = self.window_codec
            dt = torch.uint8 if c.pack is not None else like.dtype
            width = c.width if c.pack is not None else like.shape[-1]
            slab = torch.zeros(self.rows, max(self.window_size - 1, 0), width, dtype=dt, device=self.device)
            self.windows[layer] = slab
            self.window_from[layer] = torch.full((self.rows,), -1, dtype=torch.long, device=self.device)
        return slab

    def raw_capacity(self, key: str) -> int | None:
        """Rows a compressor / replay buffer can need to keep (None: unknown key, grow on demand)."""
        cfg = self.cfg
        if key.startswith("decoder_replay"):
            return self.window_size
        layer, _, kind = key.partition(".")
        if not layer.isdigit() or kind not in ("main", "index"):
            return None
        ratio = cfg.compress_ratios[int(layer)]
        overlap = (not cfg.is_v41) and (ratio == cfg.compress_rate_csa)
        return (2 * ratio - 1) if overlap else ratio - 1

    def raw_ring(self, key: str, cap: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring of ``cap`` rows per slot (the row of position p at p % cap) and the first position it holds."""
        ring = self.raw.get(key)
        if ring is None:
            ring = torch.zeros(self.rows, cap, like.shape[-1], dtype=like.dtype, device=self.device)
            self.raw[key] = ring
            self.raw_keep[key] = torch.full((self.rows,), NO_ROWS, dtype=torch.long, device=self.device)
        return ring, self.raw_keep[key]

    def raw_slab(self, key: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        slab = self.raw.get(key)
        if slab is None or slab.shape[1] < rows or slab.dtype != like.dtype:
            new = torch.zeros(self.rows, rows, like.shape[-1], dtype=like.dtype, device=self.device)
            if slab is not None and slab.dtype == like.dtype and slab.shape[1]:
                new[:, rows - slab.shape[1]:] = slab
            self.raw[key] = slab = new
        return slab


class BatchState:
    """:class:`~flashserve.model.state.SequenceState` over a batch of engine sequences (one forward)."""

    fixed_shape = False

    def __init__(self, cache: KVCache, slots: list[int], page_tables: list[list[int]] | int):
        """``page_tables``: each row's page ids, or the width to take from ``cache.page_table`` (what
        :meth:`KVCache.set_pages` wrote for these slots)."""
        self.cache = cache
        dev = cache.device
        self.slots = torch.tensor(slots, dtype=torch.long, device=dev)
        self.B = len(slots)
        if isinstance(page_tables, int):
            self.table = cache.page_table[self.slots, :page_tables]
        else:
            width = max((len(p) for p in page_tables), default=0)
            table = [p + [0] * (width - len(p)) for p in page_tables]
            self.table = torch.tensor(table, dtype=torch.long, device=dev).view(self.B, width)
        self.start = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.num_new = 0
        self._reads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._win = None

    def begin(self, num_new: int, start: torch.Tensor | None = None) -> None:
        self._win = None
        if start is not None:
            self.start = start.to(self.cache.device)
        elif self.num_new:
            self.start = self.start + self.num_new
        self.num_new = num_new

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
        cache = self.cache
        ring = cache.window_slab(layer, kv)  # row of position p at p % (W-1)
        keep = ring.shape[1]
        S = kv.shape[1]
        codec = cache.window_codec
        _, read, pos, write, n = self._window_index(keep, S, kv.device)
        if keep:
            prior_raw = ring[read]
            prior = codec.unpack(prior_raw, kv.dtype) if codec.pack is not None else prior_raw
            full = torch.cat([prior.to(kv.dtype), kv], dim=1)
        else:
            full = kv
        wf_all = cache.window_from[layer]
        wf = wf_all[self.slots]
        wf = torch.where(wf < 0, self.start, wf)
        wf_all[self.slots] = wf
        pos = torch.where(pos >= wf[:, None], pos, -1)
        if keep:
            new = kv[:, S - n:]
            ring[write] = codec.pack(new) if codec.pack is not None else new.to(ring.dtype)
        return full, pos

    # ------------------------------------------------------------ compressor partial groups / replay stash
    def compressor_raw(self, key: str, raw: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        cap = cache.raw_capacity(key)
        if cap == 0:
            return raw
        if key.startswith("decoder_replay"):  # wide rows: kept per prefilling sequence, not in a slab
            slots = self.slots.tolist()
            empty = raw.new_zeros(cap, raw.shape[-1])
            prior = torch.stack([cache.stash.get((key, s), empty) for s in slots])
            full = torch.cat([prior.to(raw.dtype), raw], dim=1)
            for i, s in enumerate(slots):
                cache.stash[(key, s)] = full[i, -cap:].clone()
            return full
        if cap is None:  # unknown buffer: keep what the model asks for, growing the slab on demand
            last = self.start + self.num_new - 1
            cap = int((last + 1 - keep_from).clamp(min=0).max()) if self.B else 0
            have = cache.raw.get(key)
            cap = max(cap, have.shape[1] if have is not None else 0)
            if cap == 0:
                return raw
            slab = cache.raw_slab(key, cap, raw)
            full = torch.cat([slab[self.slots], raw], dim=1)
            slab[self.slots] = full[:, -cap:]
            return full
        # ring: return only the retained rows the model can ask for (positions >= the last keep_from)
        ring, keep = cache.raw_ring(key, cap, raw)
        S = raw.shape[1]
        K = int((self.start - keep[self.slots]).clamp(0, cap).max()) if self.B else 0
        if K:
            pos = self.start[:, None] - K + torch.arange(K, device=raw.device)
            prior = ring[self.slots[:, None], pos % cap]
            full = torch.cat([prior, raw], dim=1)
        else:
            full = raw
        n = min(S, cap)
        pos = self.start[:, None] + torch.arange(S - n, S, device=raw.device)
        ring[self.slots[:, None], pos % cap] = raw[:, S - n:]
        keep[self.slots] = keep_from
        return full

    def raw_held_from(self, key: str) -> None:
        return None

    # ------------------------------------------------------------ global paged rows
    def _new_groups(self, key: str, new: torch.Tensor, n_new: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entry counts [B], entry index [B, G] and validity [B, G] of the groups ``new`` [B, G, .] may append
        (the first ``n_new`` of each row, past any protected prefix entries)."""
        cache = self.cache
        cnt = cache.counts[key][self.slots]
        g = torch.arange(new.shape[1], device=new.device)
        idx = cnt[:, None] + g[None, :]
        valid = (g[None, :] < n_new[:, None]) & (idx >= cache.protected[key][self.slots][:, None])
        return cnt, idx, valid

    def _stored(self, key: str, vals: torch.Tensor) -> torch.Tensor:
        """``vals`` as the pages of ``key`` hold them: packed records, or the cache's dtype."""
        codec = self.cache.key_by_name[key].codec
        return codec.pack(vals) if codec.pack is not None else vals.to(self.cache.pages[key].dtype)

    def append_compressed(self, key: str, new: torch.Tensor, n_new: torch.Tensor) -> None:
        pages = self.cache.pages[key]
        epp = pages.shape[1]
        cnt, idx, valid = self._new_groups(key, new, n_new)
        if new.shape[1]:
            rows, cols = valid.nonzero(as_tuple=True)
            if rows.numel():
                e = idx[rows, cols]
                pages[self.table[rows, e // epp], e % epp] = self._stored(key, new[rows, cols])
        self.cache.counts[key][self.slots] = cnt + n_new
        self._reads.pop(key, None)

    def compressed(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache
        gk = cache.key_by_name[key]
        pages = cache.pages[key]
        epp = pages.shape[1]
        counts = cache.counts[key]
        got = self._reads.get(key)
        if got is not None:
            return got
        n = torch.maximum(counts[self.slots], cache.protected[key][self.slots])
        nmax = int(n.max()) if self.B else 0
        npages = -(-nmax // epp)
        rows = pages[self.table[:, :npages]].flatten(1, 2)  # [B, npages*epp, width]
        if gk.codec.pack is not None:
            rows = gk.codec.unpack(rows, cache.dtype)
        self._reads[key] = (rows, n)
        return rows, n

    def compressed_rows(self, key: str, index: torch.Tensor) -> torch.Tensor:
        """The picked entries straight from their pages: a decode step of sparse attention reads (and
        unpacks) k rows per query, not the sequence's whole compressed cache."""
        got = self._reads.get(key)
        if got is not None or index.numel() == 0:  # already read whole this forward (or nothing to read)
            return gather_entries(self.compressed(key)[0], index)
        cache = self.cache
        gk = cache.key_by_name[key]
        pages = cache.pages[key]
        epp = pages.shape[1]
        page = torch.gather(self.table, 1, (index // epp).flatten(1)).view_as(index)
        rows = pages[page, index % epp]  # [B,S,k,width]
        return gk.codec.unpack(rows, cache.dtype) if gk.codec.pack is not None else rows

    # ------------------------------------------------------------ engram look-back
    def history(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        buf = self.cache.history
        if n == 0:
            return ids
        prior = buf[self.slots][:, -n:]
        full = torch.cat([prior, ids], dim=1)
        buf[self.slots] = full[:, -buf.shape[1]:]
        return full
