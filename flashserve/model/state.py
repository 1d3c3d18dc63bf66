"""Per-sequence model state across forwards, and the per-forward context.

The model reads and extends sequence state only through :class:`SequenceState`, so whole-sequence
reference forwards, cached decoding and the engine's paged caches share one attention code path.
A forward covers ``B`` rows (one per sequence) of ``S`` new tokens each, at absolute positions
``start[b] + 0..S-1``. Buffers are right-aligned: the last row of what a call returns is the newest
position, so positions are derived, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch


@dataclass(frozen=True)
class CacheKey:
    """One global compressed cache: layer ``layer``'s main rows, or its index rows (``index=True``). The same
    key names the partial-group ring of the compressor that fills that cache. A value, not a string: the
    attention layer holds its keys, and a cache maps them to typed storage without parsing names."""

    layer: int
    index: bool = False

    def __str__(self) -> str:
        return f"{self.layer}.{'index' if self.index else 'main'}"


class Replay(Enum):
    """The decoder-replay stash's buffers (V4.1 encoder-only prefill,
    docs/architecture.md#encoder-decoder-and-bounded-replay): the residual streams, the FFN ``pre`` mixing weights, and
    (token id, position) of the last window of prompt positions."""

    X = "x"
    PRE = "pre"
    META = "meta"


class SequenceState(Protocol):
    """What the model needs to remember about each sequence between forwards (docs/architecture.md#kv-cache)."""

    start: torch.Tensor  # [B] absolute position of each row's first new token
    num_new: int  # S
    fixed_shape: bool  # shapes follow from S and host-known sizes only; nothing may read a value back

    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this forward's window rows ``kv`` [B,S,d]; return (prior ++ new) [B,T,d] and their
        positions [B,T] (−1 where a slot holds no row)."""

    def compressor_raw(self, key: CacheKey, raw: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
        """Append raw compressor rows [B,S,c]; return (retained ++ new) [B,R,c], right-aligned; retain rows
        at positions >= keep_from [B] for the next forward."""

    def replay(self, buffer: Replay, rows: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
        """The decoder-replay stash: as :meth:`compressor_raw`, for one of its buffers (kept only while a
        sequence prefills encoder-only)."""

    def raw_held_from(self, key: CacheKey) -> torch.Tensor | None:
        """[B] first position of the rows the last :meth:`compressor_raw` of ``key`` returned that hold
        anything (None: all of them do)."""

    def append_compressed(self, key: CacheKey, new: torch.Tensor, n_new: torch.Tensor) -> None:
        """Append ``n_new[b]`` entries of ``new`` [B,G,c] (left-aligned) to a global cache."""

    def compressed(self, key: CacheKey) -> tuple[torch.Tensor, torch.Tensor]:
        """All entries of a global cache [B,T,c] (left-aligned) and their counts [B]."""

    def compressed_rows(self, key: CacheKey, index: torch.Tensor) -> torch.Tensor:
        """Entries ``index`` [B,S,k] of a global cache (each below the T that :meth:`compressed` would
        return): [B,S,k,c]. Sparse attention reads only the rows it picked, not the whole cache."""

    def history(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` token ids before this forward's rows followed by ``ids``: [B, n+S]; −1 for none."""

    def index_pages(self, key: CacheKey) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A global index cache as FP4 records in CPU pages, for the indexer's kernel: (pages [N, per_page,
        record], page table [B, P], entry counts [B]); None where the state keeps it otherwise."""


def gather_entries(entries: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``entries`` [B,T,c] at ``index`` [B,S,k] → [B,S,k,c]."""
    B, S, k = index.shape
    rows = entries[:, None].expand(-1, S, -1, -1)
    return torch.gather(rows, 2, index[..., None].expand(-1, -1, -1, entries.shape[-1]))


def _right_positions(last: torch.Tensor, length: int) -> torch.Tensor:
    """Positions of a right-aligned buffer of ``length`` rows whose last row is at ``last`` [B]."""
    return last[:, None] - torch.arange(length - 1, -1, -1, device=last.device)


@dataclass
class DenseState:
    """Float state in plain growing tensors, one row per sequence (reference cache and test oracle).

    ``window_size`` bounds the window rings; compressed caches grow with the sequence.
    """

    batch: int
    window_size: int
    device: torch.device | str = "cpu"
    start: torch.Tensor = field(init=False)
    num_new: int = 0
    fixed_shape = False
    _windows: dict[int, torch.Tensor] = field(default_factory=dict)
    _window_from: dict[int, torch.Tensor] = field(default_factory=dict)
    _raw: dict[CacheKey | Replay, torch.Tensor] = field(default_factory=dict)
    _entries: dict[CacheKey, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.start = torch.zeros(self.batch, dtype=torch.long, device=self.device)

    @property
    def length(self) -> torch.Tensor:
        """Tokens seen so far per row (after the current forward's :meth:`begin`)."""
        return self.start + self.num_new

    def begin(self, num_new: int, start: torch.Tensor | None = None) -> None:
        """Start a forward of ``num_new`` tokens per row, continuing where the last one ended.

        ``start`` may restate that position (or, inside one forward, move within it for the decoder
        replay); a fresh state starts at 0. Anything else would desynchronise the cached rows (rolling back
        rejected speculative tokens is not supported by this float state).
        """
        end = self.start + self.num_new
        if start is not None:
            start = start.to(self.device)
            if bool((start > end).any()) or (not self._touched() and bool((start != 0).any())):
                raise ValueError(f"state holds positions < {end.tolist()}; cannot start at {start.tolist()}")
            self.start = start
        else:
            self.start = end
        self.num_new = num_new

    def _touched(self) -> bool:
        return bool(self._windows or self._raw or self._entries or self._ids is not None)

    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prior = self._windows.get(layer)
        full = kv if prior is None else torch.cat([prior, kv], dim=1)
        last = self.start + self.num_new - 1
        pos = _right_positions(last, full.shape[1])
        first = self._window_from.setdefault(layer, self.start.clone())
        pos = torch.where(pos >= first[:, None], pos, -1)
        keep = self.window_size - 1
        self._windows[layer] = full[:, max(full.shape[1] - keep, 0):] if keep > 0 else full[:, :0]
        return full, pos

    def compressor_raw(self, key: CacheKey | Replay, raw: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
        prior = self._raw.get(key)
        full = raw if prior is None else torch.cat([prior, raw], dim=1)
        last = self.start + self.num_new - 1
        keep = int((last + 1 - keep_from).clamp(min=0).max()) if full.shape[0] else 0
        self._raw[key] = full[:, full.shape[1] - min(keep, full.shape[1]):]
        return full

    replay = compressor_raw  # one growing buffer per key either way

    def raw_held_from(self, key: CacheKey) -> None:
        return None

    def compressed(self, key: CacheKey) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self._entries:
            raise KeyError(f"no compressed cache {key} yet")
        return self._entries[key]

    def append_compressed(self, key: CacheKey, new: torch.Tensor, n_new: torch.Tensor) -> None:
        entries, count = self._entries.get(key, (None, None))
        if entries is None:
            entries = new.new_zeros(new.shape[0], 0, new.shape[-1])
            count = torch.zeros(new.shape[0], dtype=torch.long, device=new.device)
        total = int((count + n_new).max()) if new.shape[0] else 0
        if total > entries.shape[1]:
            pad = entries.new_zeros(entries.shape[0], total - entries.shape[1], entries.shape[-1])
            entries = torch.cat([entries, pad], dim=1)
        g = torch.arange(new.shape[1], device=new.device)
        valid = g[None, :] < n_new[:, None]
        rows, cols = valid.nonzero(as_tuple=True)
        entries = entries.index_put((rows, count[rows] + cols), new[rows, cols])
        count = count + n_new
        self._entries[key] = (entries, count)

    def compressed_rows(self, key: CacheKey, index: torch.Tensor) -> torch.Tensor:
        entries, _ = self.compressed(key)
        return gather_entries(entries, index)

    def index_pages(self, key: CacheKey) -> None:
        return None

    def history(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        prior = self._ids
        if prior is None or prior.shape[1] < n:
            pad = torch.full((ids.shape[0], n), -1, dtype=ids.dtype, device=ids.device)
            prior = pad if prior is None else torch.cat([pad, prior], dim=1)[:, -n:]
        full = torch.cat([prior[:, prior.shape[1] - n:], ids], dim=1)
        self._ids = full[:, full.shape[1] - n:]
        return full
