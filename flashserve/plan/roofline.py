"""One decode step on one GPU: bytes moved, FLOPs, link traffic, overheads, and the step time.

step time = max(t_mem, t_flop) combined with t_comm (a fraction ``comm_overlap`` hidden, the rest added)
            + layers × layer overhead + passes × pass overhead (+ one fixed speculative-step cost when drafting).
All terms are per GPU of the busiest attention-DP rank (sequences are dealt round-robin; every MoE layer
synchronises all ranks); experts are spread evenly over EP ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .dispatch import COMBINE_BYTES, DISPATCH_BYTES
from .dtypes import PEAK_ORDER, WEIGHT_BYTES
from .hardware import Efficiency, Hardware
from .model_terms import ModelTerms, expected_distinct_experts


@dataclass(frozen=True)
class Deployment:
    """A model placed on hardware: parallel layout, dtypes and drafter depth."""

    model: ModelTerms
    hw: Hardware
    eff: Efficiency
    gpus: int
    tp: int
    ep: int
    dp: int
    expert_dtype: str
    dense_dtype: str
    draft_tokens: int = 0
    stack: str | None = None  # serving-stack profile laid over the hardware's efficiency terms

    @property
    def ep_link(self) -> tuple[str, float]:
        """Link carrying EP traffic: NVLink inside one scale-up domain, else the scale-out NIC."""
        if self.ep <= self.hw.scaleup_domain:
            return "scale-up", self.hw.scaleup_bw
        return "scale-out", self.hw.scaleout_bw or self.hw.scaleup_bw


@dataclass(frozen=True)
class DecodeStep:
    """Every term of one decode step on one GPU (bytes, FLOPs, seconds)."""

    sequences_per_rank: float
    rows_per_sequence: int
    distinct_experts_per_layer: float
    bytes_dense: float
    bytes_experts: float
    bytes_kv: float
    bytes_draft: float
    flops_dense: float
    flops_experts: float
    flops_attention: float
    flops_draft: float
    comm_bytes_ep: float
    comm_bytes_tp: float
    comm_bytes_host: float
    comm_link: str
    t_mem: float
    t_flop: float
    t_comm: float
    t_overhead: float  # all fixed time, t_spec_fixed included
    t_step: float
    bound: str
    t_spec_fixed: float = 0.0  # the speculative step's fixed cost (part of t_overhead)
    bytes_kv_rows: float = 0.0  # of bytes_kv: what the verification rows beyond the first gather on their own

    @property
    def bytes_total(self) -> float:
        return self.bytes_dense + self.bytes_experts + self.bytes_kv + self.bytes_draft

    def as_dict(self) -> dict[str, float | str]:
        return {**asdict(self), "bytes_total": self.bytes_total}


def _peak(dep: Deployment, dtype: str) -> float:
    return dep.hw.peak(dtype, PEAK_ORDER[dtype]) * dep.eff.eta_flop


def decode_step(dep: Deployment, concurrency: float, ctx: float) -> DecodeStep:
    """Terms of one decode step with ``concurrency`` sequences at mean KV length ``ctx``."""
    m, hw, eff = dep.model, dep.hw, dep.eff
    wb_e, wb_d = WEIGHT_BYTES[dep.expert_dtype], WEIGHT_BYTES[dep.dense_dtype]
    rows = 1 + dep.draft_tokens
    b = float(math.ceil(concurrency / dep.dp))  # sequences on the busiest attention rank (it sets the pace)
    tokens = concurrency * rows  # rows entering every MoE layer, all GPUs together
    distinct = expected_distinct_experts(m.n_experts, m.top_k, tokens)

    bytes_dense = m.dense_params_decode * wb_d / dep.tp
    bytes_experts = m.n_moe_layers * distinct * m.expert_params * wb_e / dep.gpus
    # an MQA/MLA latent is read by every TP rank of its sequence; sparse layers gather window and selected
    # entries per query row, so verification rows multiply them (model_terms.LayerAttention.row_bytes)
    bytes_kv = b * m.kv_read_bytes(ctx, rows)
    bytes_kv_rows = b * (rows - 1) * sum(layer.row_bytes(ctx) for layer in m.attention)
    flops_dense = 2.0 * m.dense_params_decode * b * rows / dep.tp
    flops_experts = 2.0 * m.n_moe_layers * m.top_k * m.expert_params * tokens / dep.gpus
    flops_attn = b * rows * m.attention_flops(ctx) / dep.tp

    d = m.draft
    passes = d.passes(dep.draft_tokens)
    bytes_draft = flops_draft_dense = flops_draft_exp = flops_draft_attn = draft_ep_tokens = 0.0
    if passes:
        drows = d.rows_per_pass(dep.draft_tokens)
        dist_d = expected_distinct_experts(d.n_experts, d.top_k, concurrency * drows)
        per_pass = d.dense_params * wb_d / dep.tp + d.layers * dist_d * d.expert_params * wb_e / dep.gpus
        if d.attention is not None:
            per_pass += b * d.layers * d.attention.read_bytes(ctx, drows)  # each block row reads the window
            flops_draft_attn = passes * b * drows * d.layers * d.attention.flops(ctx) / dep.tp
        bytes_draft = passes * per_pass
        flops_draft_dense = passes * 2.0 * d.dense_params * b * drows / dep.tp
        flops_draft_exp = passes * 2.0 * d.layers * d.top_k * d.expert_params * concurrency * drows / dep.gpus
        draft_ep_tokens = passes * d.layers * d.top_k * concurrency * drows

    t_mem = (bytes_dense + bytes_experts + bytes_kv + bytes_draft) / (hw.hbm_bw * eff.eta_mem)
    attn_dtype = "bf16" if m.kv_dtype == "bf16" else "fp8"
    t_flop = ((flops_dense + flops_draft_dense) / _peak(dep, dep.dense_dtype)
              + (flops_experts + flops_draft_exp) / _peak(dep, dep.expert_dtype)
              + (flops_attn + flops_draft_attn) / _peak(dep, attn_dtype))

    # EP: each GPU sends its share of token-expert pairs to remote ranks and receives the combine back.
    remote = 1.0 - 1.0 / dep.ep
    per_pair = m.hidden_size * (DISPATCH_BYTES + COMBINE_BYTES)
    pairs = m.n_moe_layers * m.top_k * tokens + draft_ep_tokens
    comm_ep = pairs * remote * per_pair / dep.gpus
    # Attention TP: one all-reduce of the layer output per layer (ring: 2(tp-1)/tp of the data), plus one
    # for the MoE output when experts are TP-sharded instead of expert-parallel.
    comm_tp = 0.0
    if dep.tp > 1:
        reductions = 1 if dep.ep > 1 else 2
        comm_tp = reductions * m.n_layers * b * rows * m.hidden_size * 2.0 * 2.0 * (dep.tp - 1) / dep.tp
    comm_host = b * rows * m.host_row_bytes_per_token / dep.tp  # engram rows, prefetchable
    link, bw = dep.ep_link
    host_bw = hw.host_link_bw if hw.host_link_bw > 0 else hw.hbm_bw
    t_comm = (comm_ep / (bw * eff.eta_comm) + comm_tp / (hw.scaleup_bw * eff.eta_comm)
              + comm_host / (host_bw * eff.eta_comm))

    t_roof = max(t_mem, t_flop)
    t_body = max(t_roof, t_comm) + (1.0 - eff.comm_overlap) * min(t_roof, t_comm)
    layers = m.n_layers + passes * d.layers
    t_spec = eff.spec_step_overhead_us * 1e-6 if passes else 0.0  # fixed cost of a speculative step
    t_over = (layers * eff.layer_overhead_us + (1 + passes) * eff.pass_overhead_us) * 1e-6 + t_spec
    terms = {"memory": t_mem, "compute": t_flop, "communication": t_comm, "overhead": t_over}
    return DecodeStep(
        sequences_per_rank=b, rows_per_sequence=rows, distinct_experts_per_layer=distinct,
        bytes_dense=bytes_dense, bytes_experts=bytes_experts, bytes_kv=bytes_kv, bytes_draft=bytes_draft,
        flops_dense=flops_dense, flops_experts=flops_experts, flops_attention=flops_attn,
        flops_draft=flops_draft_dense + flops_draft_exp + flops_draft_attn,
        comm_bytes_ep=comm_ep, comm_bytes_tp=comm_tp, comm_bytes_host=comm_host, comm_link=link,
        t_mem=t_mem, t_flop=t_flop, t_comm=t_comm, t_overhead=t_over, t_step=t_body + t_over,
        bound=max(terms, key=terms.get), t_spec_fixed=t_spec, bytes_kv_rows=bytes_kv_rows,
    )
