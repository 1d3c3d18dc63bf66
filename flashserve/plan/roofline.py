"""One decode step on one GPU: bytes moved, FLOPs, link traffic, overheads, and the step time.

step time = max(t_mem, t_flop) combined with t_comm (a fraction ``comm_overlap`` hidden, the rest added)
            + t_host + t_disk (routed experts placed off the device of a machine: :mod:`flashserve.plan.tiers`;
              the largest of the three instead of the sum where the tiers overlap)
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
from .machine import GB, TERA
from .model_terms import ModelTerms, expected_distinct_experts
from .tiers import ExpertPlacement


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
    placement: ExpertPlacement | None = None  # routed experts by tier on a machine (None: all on the device)
    tables_on_disk: bool = False  # engram tables on a machine's disk: each token's rows read from it
    untimed_compute: bool = False  # the device lists no FLOP/s: its compute is not timed (memory-bound only)
    head_dtype: str | None = None  # the LM head and embeddings' dtype (None: dense_dtype)

    def dense_weight_bytes(self, params: float, head: float) -> float:
        """Bytes of ``params`` dense weights of which ``head`` are the LM head or embeddings (at head_dtype)."""
        wb_d = WEIGHT_BYTES[self.dense_dtype]
        if self.head_dtype is None:
            return params * wb_d
        return (params - head) * wb_d + head * WEIGHT_BYTES[self.head_dtype]

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
    # routed experts off the device (a machine's placement, flashserve.plan.tiers); whole machine, not per GPU
    bytes_host_experts: float = 0.0  # read from host memory by the CPU kernels, or moved over the link
    bytes_disk_experts: float = 0.0  # read from disk
    flops_host_experts: float = 0.0  # computed by the CPU expert kernels
    t_host: float = 0.0  # host-memory expert work: CPU kernels, or the transfer over the link
    t_disk: float = 0.0
    host_path: str = ""  # "cpu" or "link": who does the host tier's work ("" without one)
    t_device: float = 0.0  # the device's own work: memory, compute and links combined (no tier, no overhead)
    t_disk_tables: float = 0.0  # of t_disk: engram rows read from disk (tables on disk)

    @property
    def bytes_total(self) -> float:
        return self.bytes_dense + self.bytes_experts + self.bytes_kv + self.bytes_draft

    def as_dict(self) -> dict[str, float | str]:
        return {**asdict(self), "bytes_total": self.bytes_total}


def _peak(dep: Deployment, dtype: str) -> float:
    if dep.untimed_compute and not dep.hw.has_peak(PEAK_ORDER[dtype]):
        return math.inf  # FLOP/s not published: the compute term is left out (--memory-bound-only)
    return dep.hw.peak(dtype, PEAK_ORDER[dtype]) * dep.eff.eta_flop


def decode_step(dep: Deployment, concurrency: float, ctx: float) -> DecodeStep:
    """Terms of one decode step with ``concurrency`` sequences at mean KV length ``ctx``."""
    m, hw, eff = dep.model, dep.hw, dep.eff
    wb_e, wb_d = WEIGHT_BYTES[dep.expert_dtype], WEIGHT_BYTES[dep.dense_dtype]
    rows = 1 + dep.draft_tokens
    b = float(math.ceil(concurrency / dep.dp))  # sequences on the busiest attention rank (it sets the pace)
    tokens = concurrency * rows  # rows entering every MoE layer, all GPUs together
    distinct = expected_distinct_experts(m.n_experts, m.top_k, tokens, m.routing_skew)

    bytes_dense = dep.dense_weight_bytes(m.dense_params_decode, m.head_params) / dep.tp
    experts_all = m.n_moe_layers * distinct * m.expert_params * wb_e  # every tier, the whole deployment
    bytes_experts = experts_all / dep.gpus
    # an MQA/MLA latent is read by every TP rank of its sequence; sparse layers gather window and selected
    # entries per query row, so verification rows multiply them (model_terms.LayerAttention.row_bytes)
    bytes_kv = b * m.kv_read_bytes(ctx, rows)
    bytes_kv_rows = b * (rows - 1) * sum(layer.row_bytes(ctx) for layer in m.attention)
    head = m.head_params if dep.head_dtype is not None else 0  # computed at the head dtype's rate
    flops_dense = 2.0 * (m.dense_params_decode - head) * b * rows / dep.tp
    flops_head = 2.0 * head * b * rows / dep.tp
    flops_experts = 2.0 * m.n_moe_layers * m.top_k * m.expert_params * tokens / dep.gpus
    tier = _tiers(dep, experts_all, flops_experts * dep.gpus)
    if tier is not None:
        bytes_experts, flops_experts = tier["bytes_device"], tier["flops_device"]
    flops_attn = b * rows * m.attention_flops(ctx) / dep.tp

    d = m.draft
    passes = d.passes(dep.draft_tokens)
    bytes_draft = flops_draft_dense = flops_draft_exp = flops_draft_attn = draft_ep_tokens = 0.0
    if passes:
        drows = d.rows_per_pass(dep.draft_tokens)
        dist_d = expected_distinct_experts(d.n_experts, d.top_k, concurrency * drows, m.routing_skew)
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
              + (flops_head / _peak(dep, dep.head_dtype) if flops_head else 0.0)
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
    t_tables = 0.0
    if dep.tables_on_disk:  # read from the disk instead, each row a read of its own
        machine = dep.hw.machine
        assert machine is not None
        reads = b * rows * m.host_reads_per_token
        t_tables = ((comm_host / (machine.disk_read_gbs * GB) if machine.disk_read_gbs else 0.0)
                    + (reads / machine.disk_iops if machine.disk_iops else 0.0))
        comm_host = 0.0
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
    t_host, t_disk = 0.0, t_tables
    t_tiers = t_body + t_tables
    if tier is not None:  # after the device's work (a decode stream waits for its experts), or beside it
        t_host, t_disk = tier["t_host"], tier["t_disk"] + t_tables
        if tier["host_path"]:
            terms["host" if tier["host_path"] == "cpu" else "link"] = t_host
        overlapped = dep.placement is not None and dep.placement.overlap == "overlapped"
        t_tiers = max(t_body, t_host, t_disk) if overlapped else t_body + t_host + t_disk
    if t_disk:
        terms["disk"] = t_disk
    return DecodeStep(
        sequences_per_rank=b, rows_per_sequence=rows, distinct_experts_per_layer=distinct,
        bytes_dense=bytes_dense, bytes_experts=bytes_experts, bytes_kv=bytes_kv, bytes_draft=bytes_draft,
        flops_dense=flops_dense + flops_head, flops_experts=flops_experts, flops_attention=flops_attn,
        flops_draft=flops_draft_dense + flops_draft_exp + flops_draft_attn,
        comm_bytes_ep=comm_ep, comm_bytes_tp=comm_tp, comm_bytes_host=comm_host, comm_link=link,
        t_mem=t_mem, t_flop=t_flop, t_comm=t_comm, t_overhead=t_over, t_step=t_tiers + t_over, t_device=t_body,
        bound=max(terms, key=terms.get), t_spec_fixed=t_spec, bytes_kv_rows=bytes_kv_rows,
        **({k: tier[k] for k in ("bytes_host_experts", "bytes_disk_experts", "flops_host_experts", "t_host",
                                 "host_path")} if tier is not None else {}),
        t_disk=t_disk, t_disk_tables=t_tables,
    )


def host_expert_rate(dep: Deployment) -> float:
    """Bytes/s at which the CPU's expert kernels read host memory: the machine's measured rate
    (``host.expert_gbs``, no efficiency term), else host bandwidth x ``eta_host_mem``."""
    m = dep.hw.machine
    assert m is not None
    if m.expert_gbs:
        return m.expert_gbs * GB
    return (m.host_bandwidth_gbs or 0.0) * GB * dep.eff.host_mem_efficiency


def _tiers(dep: Deployment, experts_bytes: float, experts_flops: float) -> dict | None:
    """Split one step's routed-expert bytes and FLOPs (``experts_bytes``/``experts_flops``: every tier, the
    whole deployment) over a machine's tiers and time the work off the device (None: no placement).

    The placement's fractions (:meth:`~flashserve.plan.tiers.ExpertPlacement.fraction`: resident/E, host/E and
    disk/E for a static placement, or a cache's hit rate and its misses split by experts) say how much of the bytes
    is read from device memory, from host memory and from disk; an expert read from disk is then computed as one in memory (host memory beside
    a discrete GPU, the device memory otherwise). A machine without a GPU that gives its expert kernels'
    measured rate (host.expert_gbs) times every expert at that rate, with or without a placement: the dense
    work runs on the same cores before them, so the two are summed like any tier. Host-memory experts are read
    by the CPU expert kernels at their measured rate (host.expert_gbs) or host bandwidth x eta_host_mem (eta_mem where the profile has none;
    their FLOPs at host.expert_tflops x eta_flop when it is given, the slower of the two), or under ``gpu`` moved over each GPU's link (its share) at link bandwidth x eta_comm and read again
    from GPU memory. The disk is read at its stated bandwidth (no efficiency term)."""
    pl, m, eff = dep.placement, dep.hw.machine, dep.eff
    cpu_kernels = m is not None and m.kind == "cpu" and bool(m.expert_gbs)
    if m is None or (pl is None and not cpu_kernels):
        return None
    f_res, f_host, f_disk = ((pl.fraction("resident"), pl.fraction("host"), pl.fraction("disk")) if pl is not None
                             else (1.0, 0.0, 0.0))
    disk = experts_bytes * f_disk
    t_disk = disk / ((m.disk_read_gbs or 0.0) * GB) if disk else 0.0
    out = {"bytes_disk_experts": disk, "t_disk": t_disk, "bytes_host_experts": 0.0, "flops_host_experts": 0.0,
           "t_host": 0.0, "host_path": ""}
    if cpu_kernels:  # no GPU: the CPU's expert kernels read every expert (those paged in from disk too) at their rate
        t_read = experts_bytes / (m.expert_gbs * GB)
        t_cpu = experts_flops / (m.expert_tflops * TERA * eff.eta_flop) if m.expert_tflops else 0.0
        out.update(bytes_device=0.0, flops_device=0.0, bytes_host_experts=experts_bytes,
                   flops_host_experts=experts_flops, t_host=max(t_read, t_cpu), host_path="cpu")
        return out
    if m.kind != "gpu":  # pages from disk land in the memory that computes and are read there
        out.update(bytes_device=experts_bytes * (f_res + f_disk) / dep.gpus, flops_device=experts_flops / dep.gpus)
        return out
    off = experts_bytes * (f_host + f_disk)
    if pl.host_compute == "cpu":
        t_read = off / host_expert_rate(dep) if off else 0.0
        flops_cpu = experts_flops * (f_host + f_disk)
        t_cpu = flops_cpu / (m.expert_tflops * TERA * eff.eta_flop) if m.expert_tflops and flops_cpu else 0.0
        out.update(bytes_device=experts_bytes * f_res / dep.gpus, flops_device=experts_flops * f_res / dep.gpus,
                   bytes_host_experts=off, flops_host_experts=flops_cpu, t_host=max(t_read, t_cpu), host_path="cpu")
    else:
        t_link = off / dep.gpus / (dep.hw.host_link_bw * eff.eta_comm) if off else 0.0  # each GPU's own link
        out.update(bytes_device=experts_bytes / dep.gpus, flops_device=experts_flops / dep.gpus,
                   bytes_host_experts=off, t_host=t_link, host_path="link")
    return out
