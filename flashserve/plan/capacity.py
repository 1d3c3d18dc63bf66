"""How many sequences fit in HBM at a given context, and what the host must hold (V4.1 engram tables)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .dtypes import WEIGHT_BYTES
from .roofline import Deployment


@dataclass(frozen=True)
class Capacity:
    """Per-GPU memory budget and the sessions it holds."""

    weight_bytes_per_gpu: float
    workspace_bytes_per_gpu: float
    kv_budget_bytes_per_gpu: float
    bytes_per_sequence: float  # global cache at the context plus bounded state
    sessions_fit: int  # across the deployment (attention-DP ranks × sessions per rank)
    host_table_bytes: float  # engram tables, one copy (host memory)
    host_fits: bool  # one copy fits in the host memory of one scale-up domain (or all GPUs if fewer)
    host_table_bytes_in_device: float = 0.0  # per device: tables held in the device's own memory (unified)
    host_expert_bytes: float = 0.0  # routed experts placed in host memory (a machine's --host-experts)
    routed_bytes_per_gpu: float = 0.0  # of weight_bytes_per_gpu: the resident routed experts
    routed_bytes_per_expert_per_gpu: float = 0.0  # one more resident expert in every MoE layer, per GPU

    def as_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)


def capacity(dep: Deployment, ctx: float) -> Capacity:
    """Sessions that fit: (usable HBM − workspace − weights) / bytes per sequence, per attention-DP rank.

    A sequence's MLA/MQA latent cache is replicated on each TP rank of its attention group, so one rank's
    budget, not the group's, bounds its sequences. On a unified-memory machine the engram tables sit in the
    same memory as the weights and come out of the same budget. On a machine with experts placed by tier
    (:mod:`flashserve.plan.tiers`) only the resident experts count against the device; host memory holds the
    engram tables and the host-memory experts; disk experts need no memory.
    """
    m, hw, eff = dep.model, dep.hw, dep.eff
    wb_d, wb_e = WEIGHT_BYTES[dep.dense_dtype], WEIGHT_BYTES[dep.expert_dtype]
    d = m.draft
    pl = dep.placement
    per_expert = m.n_moe_layers * m.expert_params * wb_e  # one expert in every MoE layer
    resident = m.n_experts if pl is None else pl.resident
    routed = m.routed_params_total * wb_e / dep.gpus if pl is None else resident * per_expert / dep.gpus
    host_experts = 0.0 if pl is None else pl.host * per_expert
    weights = dep.dense_weight_bytes(m.dense_params_total, m.head_params + m.embed_params) / dep.tp + routed
    if dep.draft_tokens and d.kind != "none":
        weights += d.dense_params * wb_d / dep.tp + d.layers * d.n_experts * d.expert_params * wb_e / dep.gpus
    workspace = hw.hbm_usable_bytes * eff.workspace_fraction
    host = 0.0 if dep.tables_on_disk else m.host_params * (1.0 + 1.0 / 32)  # FP8 rows + a UE8M0 scale per 32
    in_device = host / dep.gpus if hw.unified else 0.0
    budget = hw.hbm_usable_bytes - workspace - weights - in_device
    per_seq = m.sequence_bytes(ctx)
    per_rank = math.floor(budget / per_seq) if budget > 0 and per_seq > 0 else 0
    host_gpus = min(dep.gpus, hw.scaleup_domain)
    return Capacity(
        weight_bytes_per_gpu=weights, workspace_bytes_per_gpu=workspace, kv_budget_bytes_per_gpu=max(budget, 0.0),
        bytes_per_sequence=per_seq, sessions_fit=per_rank * dep.dp, host_table_bytes=host,
        host_fits=host + host_experts <= hw.host_mem_bytes * host_gpus, host_table_bytes_in_device=in_device,
        host_expert_bytes=host_experts, routed_bytes_per_gpu=routed,
        routed_bytes_per_expert_per_gpu=per_expert / dep.gpus,
    )
