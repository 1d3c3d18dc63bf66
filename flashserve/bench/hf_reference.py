"""Random transformers ``DeepseekV4ForCausalLM`` models: the V4 baseline of the benchmarks and the oracle of
the parity tests. transformers is a test/benchmark dependency only; the engine never imports this."""

from __future__ import annotations

import torch


@torch.no_grad()
def randomize_hf_v4(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every floating parameter and buffer of a HF V4 model random values (HF initialises some to
    zeros or ones, behind which a broken path could hide), and ``tid2eid`` random distinct experts."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(("scale", "base", "sinks", "position_bias")):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * max(0.02, p.shape[-1] ** -0.5))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            experts, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
            b.copy_(torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(b.shape[0])]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model
