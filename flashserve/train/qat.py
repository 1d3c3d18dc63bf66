"""Training-time patches: straight-through estimators for the QAT quantisation points, MXFP4 fake-quantised
expert weights, and the router's auxiliary-loss-free bias balancing.

The model's quantisers round (no gradient); training wraps them as ``x + (q(x) - x).detach()`` so the forward
is exactly the served one and the gradient passes straight through. Everything is undone on exit.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..model import attention, draft, quant
from ..model.moe import Experts, Gate


def _ste(fn):
    def wrapped(x, *args, **kwargs):
        q = fn(x, *args, **kwargs)
        if not x.requires_grad or q is x:
            return q
        return x + (q - x).detach()
    wrapped.__wrapped__ = fn
    return wrapped


def _fake_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 quantise->dequantise of a weight [.., rows, cols] as the checkpoint stores experts."""
    flat = w.detach().reshape(-1, w.shape[-1]).float()
    q = quant.dequantize_mxfp4(*quant.quantize_mxfp4(flat), dtype=torch.float32).reshape(w.shape).to(w.dtype)
    return w + (q - w).detach()


@contextlib.contextmanager
def training_patches(*, fp4_experts: bool = False) -> Iterator[None]:
    """STE around the activation quantisers; with ``fp4_experts`` the routed experts' weights are used as the
    FP4 checkpoint stores them (straight-through)."""
    saved = [(attention, "fake_quant_fp8"), (attention, "fake_quant_fp4"), (draft, "fake_quant_fp8")]
    originals = [(mod, name, getattr(mod, name)) for mod, name in saved]
    orig_weights = Experts.expert_weights
    try:
        for mod, name, fn in originals:
            setattr(mod, name, _ste(fn))
        if fp4_experts:
            cache: dict[tuple[int, str], torch.Tensor] = {}  # one rounding per weight per forward

            def expert_weights(self, name, dtype, index=None):
                w = orig_weights(self, name, dtype, None)
                if torch.is_grad_enabled() and w.requires_grad:
                    key = (id(self), name)
                    if key not in cache:
                        cache[key] = _fake_mxfp4(w)
                    w = cache[key]
                return w if index is None else w[index]
            Experts.expert_weights = expert_weights
        yield
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)
        Experts.expert_weights = orig_weights


class RouterBalancer:
    """DeepSeek's auxiliary-loss-free balancing: after each step, ``bias += rate · sign(mean load - load)``
    for every learned router (the bias only shifts which experts are picked, so it gets no gradient)."""

    def __init__(self, model: torch.nn.Module, rate: float = 1e-3):
        self.rate = rate
        self.counts: dict[Gate, torch.Tensor] = {}
        self.handles = []
        for m in model.modules():
            if isinstance(m, Gate) and not m.hash_routed:
                self.handles.append(m.register_forward_hook(self._hook))

    def _hook(self, gate: Gate, args, out) -> None:
        idx = out[0]
        c = torch.bincount(idx.flatten(), minlength=gate.weight.shape[0]).float()
        self.counts[gate] = self.counts.get(gate, 0) + c

    @torch.no_grad()
    def step(self) -> None:
        for gate, c in self.counts.items():
            gate.bias.add_(self.rate * torch.sign(c.mean() - c))
        self.counts.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
