"""Engram tables in host memory, memory-mapped from the checkpoint's files.

V4.1's engram tables (203 GB in FP8 for V4.1-Flash) never go to a GPU: each engram layer's ``engram.embed``
is wrapped in a :class:`HostTable`, which ``model.to(device)`` leaves in host memory and which gathers, per
step, only the rows the step's hashed n-grams name, then moves those rows to the device. Loaded from a
checkpoint folder, the table's tensors are views of a private (copy-on-write, never written) memory map of the
safetensors file: every rank of a node reads the same page-cache pages, so the node holds one copy, not one
per rank.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("flashserve.parallel")

_DTYPES = {"F8_E4M3": torch.uint8, "F8_E8M0": torch.uint8, "U8": torch.uint8, "I8": torch.int8, "BF16": torch.bfloat16,
           "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I32": torch.int32,
           "I64": torch.int64}


class HostTable(nn.Module):
    """An embedding table kept in host memory: rows gathered on the host, only they sent to the device."""

    def __init__(self, table: nn.Module):
        super().__init__()
        object.__setattr__(self, "table", table)  # not a submodule: model.to(device) does not move it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids.cpu()).to(ids.device)

    @property
    def weight(self) -> torch.Tensor:  # what callers that read ``embed.weight`` (dtype, rows) expect
        return self.table.weight

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.table.parameters()) + list(self.table.buffers()))


def _index(folder: Path) -> dict[str, tuple[Path, str, list[int], int, int]]:
    """Tensor name -> (file, dtype, shape, absolute start, end) of every safetensors file of ``folder``."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            a, b = meta["data_offsets"]
            out[name] = (f, meta["dtype"], meta["shape"], 8 + n + a, 8 + n + b)
    return out


class _Maps:
    """Open memory maps, one per file, kept alive by the tensors' owner."""

    def __init__(self):
        self.maps: dict[Path, mmap.mmap] = {}

    def tensor(self, entry) -> torch.Tensor:
        f, dtype, shape, start, end = entry
        if f not in self.maps:
            with open(f, "rb") as fh:
                self.maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self.maps[f], dtype=torch.uint8, count=end - start, offset=start)
        return flat.view(_DTYPES[dtype]).view(shape)


def host_engram_tables(model, folder: str | Path | None = None) -> int:
    """Wrap every engram table of ``model`` in a :class:`HostTable` (in host memory); with a checkpoint
    ``folder``, make the tables views of the memory-mapped files where the stored format is the one held (FP8
    rows + scales into a packed table, or the same float dtype). On the empty ``meta`` model (``load_model``'s
    ``prepare``) a mapped table is then never read by the loader; a table that cannot be mapped is left for the
    loader and wrapped by a second call after loading. Returns the bytes memory-mapped."""
    from ..model.packed import PackedEmbedding

    index = _index(Path(folder)) if folder is not None and Path(folder).is_dir() else {}
    maps = _Maps()
    mapped = 0
    for i, block in enumerate(model.layers):
        eng = getattr(block, "engram", None)
        if eng is None or isinstance(eng.embed, HostTable):
            continue
        table = eng.embed
        on_meta = any(t.is_meta for t in list(table.parameters()) + list(table.buffers()))
        if not on_meta:
            table = table.to("cpu")
        before = mapped
        w = index.get(f"layers.{i}.engram.embed.weight")
        s = index.get(f"layers.{i}.engram.embed.scale")
        with torch.no_grad():
            if w is not None and isinstance(table, PackedEmbedding) and s is not None:
                p = table.packed
                qw, sc = maps.tensor(w), maps.tensor(s)
                if qw.shape == p.qweight.shape and sc.shape == p.scale.shape:
                    p.qweight, p.scale = qw.view(p.qweight.dtype), sc.view(p.scale.dtype)
                    mapped += qw.numel() * qw.element_size() + sc.numel() * sc.element_size()
            elif w is not None and s is None and isinstance(table, nn.Embedding) and _DTYPES[w[1]] == table.weight.dtype:
                t = maps.tensor(w)
                if t.shape == table.weight.shape:
                    table.weight = nn.Parameter(t, requires_grad=False)
                    mapped += t.numel() * t.element_size()
        if on_meta and mapped == before:  # not mappable: the loader reads it; wrapped after loading
            continue
        eng.embed = HostTable(table)
    model._engram_maps = maps  # the maps live as long as the model
    if index and not mapped and any(getattr(b, "engram", None) is not None for b in model.layers):
        log.info("engram tables: stored in another format than held; kept as loaded (host memory, not mapped)")
    return mapped
