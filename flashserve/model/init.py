"""Seeded random weights for presets and tests: every floating tensor random (no zeros to hide behind)."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def _generator(seed: int, name: str) -> torch.Generator:
    """A generator seeded from ``seed`` and the tensor's own name, so a tensor's values do not depend on
    which other tensors the model has (building the drafters or not gives the same backbone)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


@torch.no_grad()
def random_init(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Fill parameters deterministically: matrices ~ N(0, std) (fan-in scaled when small), norms ≈ 1,
    mHC scales/bases, sinks and router biases small random, hash tables random expert ids."""
    for name, p in model.named_parameters():
        gen = _generator(seed, name)
        leaf = name.rsplit(".", 1)[-1]
        shape = p.shape
        if "norm" in name or leaf in ("q_weight", "k_weight"):
            val = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif leaf.endswith("_scale") or leaf.endswith("_base") or leaf in ("attn_sink", "bias", "bias_vl", "ape"):
            val = 0.5 * torch.randn(shape, generator=gen)
        elif leaf.endswith("_fn"):
            val = 0.02 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            val = torch.randn(shape, generator=gen) * max(std, fan_in ** -0.5)
        p.copy_(val.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            gen = _generator(seed, name)
            n_experts = model.get_submodule(name.rsplit(".", 1)[0]).weight.shape[0]
            b.copy_(torch.stack([torch.randperm(n_experts, generator=gen)[:b.shape[1]] for _ in range(b.shape[0])]))
    return model
