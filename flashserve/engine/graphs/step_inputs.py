"""The four tensors a decode step takes, built on the host from what the scheduler knows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    """One step's host-built metadata as tensors, padded to a bucket."""

    ids: torch.Tensor  # [Bp, R] token ids of the rows to compute
    start: torch.Tensor  # [Bp] position of each request's first row
    slots: torch.Tensor  # [Bp] cache slot (padding: the scratch slot)
    table: torch.Tensor  # [Bp, P] page ids (padding: the scratch page)
    compiled: bool = True  # run through the compiled regions (else eagerly, unpadded)
