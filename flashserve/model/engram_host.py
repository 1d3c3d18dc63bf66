"""Engram tables in host memory, memory-mapped from the checkpoint's files.

V4.1's engram tables (203 GB in FP8 for V4.1-Flash) never go to a GPU: each engram layer's ``engram.embed``
is wrapped in a :class:`HostTable`, which ``model.to(device)`` leaves in host memory and which gathers, per
step, only the rows the step's hashed n-grams name, then moves those rows to the device. Loaded from a
checkpoint folder (with ``mmap``, the default), the table's tensors are views of a private (copy-on-write, never
written) memory map of the safetensors file: every rank of a node reads the same page-cache pages, so the node
holds one copy, not one per rank.
"""

from __future__ import annotations

import torch
from torch import nn


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


def host_engram_tables(model) -> int:
    """Wrap every engram table of ``model`` in a :class:`HostTable` (in host memory; loaded from a checkpoint with
    ``mmap``, the tables are views of the mapped files: :func:`flashserve.model.loader.load_model`). Returns the
    bytes the tables hold."""
    held = 0
    for block in model.layers:
        eng = getattr(block, "engram", None)
        if eng is None:
            continue
        if not isinstance(eng.embed, HostTable):
            eng.embed = HostTable(eng.embed.to("cpu"))
        held += eng.embed.host_bytes()
    return held
