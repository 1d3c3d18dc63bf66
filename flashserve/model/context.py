"""The per-forward context: positions, RoPE angles, state, and what layers publish to later layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .rope import RotaryTables
from .state import SequenceState


@dataclass
class ForwardContext:
    """Everything one forward shares across layers. Built by the model, read by its blocks."""

    state: SequenceState
    positions: torch.Tensor  # [B,S] absolute positions of the new rows
    input_ids: torch.Tensor  # [B,S]
    rope: RotaryTables
    fake_quant: bool
    image_mask: torch.Tensor | None = None  # [B,S] True at image-span positions
    noncausal: bool = False  # drafting: every key the state returns is visible to every row
    # layers whose compressed entries were already produced this forward (decoder replay)
    produced: set[int] = field(default_factory=set)
    # index source layer -> (top-k entry indices [B,S,k], valid [B,S,k]) for this forward's rows
    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    candidates: torch.Tensor | None = None  # [B,S,T] candidate-pool mask published by the candidate source
    candidate_blocks: torch.Tensor | None = None  # [B*S, n] its blocks (-1: none), where it ran as a kernel
    _angles: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def angles(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B,S,rope/2] of the query rows for ``main`` or ``compress`` RoPE (memoised)."""
        if kind not in self._angles:
            self._angles[kind] = self.rope.angles(kind, self.positions)
        return self._angles[kind]

    def narrow(self, first: int) -> "ForwardContext":
        """The same forward restricted to rows ``first:`` (decoder replay); shares state and publications."""
        return ForwardContext(
            state=self.state, positions=self.positions[:, first:], input_ids=self.input_ids[:, first:],
            rope=self.rope, fake_quant=self.fake_quant,
            image_mask=None if self.image_mask is None else self.image_mask[:, first:],
            produced=self.produced)
