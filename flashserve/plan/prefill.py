"""Prefill: GPU-seconds per prompt token at large batch, and the time to first token of one request.

V4.1 runs only its encoder per prompt token (≈ active-prefill parameters) and replays the decoder on the
last ``sliding_window`` rows; V3/V4 run every layer per prompt token.

On a machine whose routed experts are partly off the device (:mod:`flashserve.plan.tiers`) a prompt is run in
chunks of ``--prefill-chunk`` tokens (llama.cpp's ``-ub``, vLLM's ``--max-num-batched-tokens``), and each chunk
touches nearly every expert of a layer. The experts off the device then cost, per chunk: under ``cpu`` their
share of the expert FLOPs on the CPU (at ``host.expert_tflops`` where given) or one read of the touched ones from
host memory, whichever is slower; under ``gpu`` one transfer of the touched ones over the GPU's link (llama.cpp
moves host weights to the GPU for a large batch); from disk one read of the touched ones. Uniform routing
places the touched experts (a measured decode hit rate says nothing of a chunk's). Tiers combine as decode's do.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .dispatch import prefill_link_bytes
from .dtypes import PEAK_ORDER, WEIGHT_BYTES
from .machine import GB, TERA
from .model_terms import expected_distinct_experts
from .roofline import Deployment, host_expert_rate


@dataclass(frozen=True)
class Prefill:
    """Prefill terms (per GPU unless named otherwise)."""

    flops_per_token: float
    gpu_seconds_per_token: float  # one GPU's time per prompt token at large batch
    tokens_per_s_per_gpu: float
    replay_flops_per_request: float  # V4.1 decoder replay on the last window rows
    ttft_s: float  # one request on an idle instance, first decode step included
    bound: str
    tiers: PrefillTiers | None = None  # the experts off the device (a machine's placement)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {k: v for k, v in asdict(self).items() if k != "tiers"}
        out["tiers"] = self.tiers.as_dict() if self.tiers else None
        return out


def _gpu_seconds(dep: Deployment, ctx: float, expert_share: float = 1.0) -> tuple[float, float, str]:
    """(FLOPs per prompt token, GPU-seconds per token, bound) for a prompt attending ``ctx`` keys on average.

    Compute runs at the profile's prefill efficiency; dispatch/combine crosses the scale-out network once per
    remote node (:mod:`flashserve.plan.dispatch`) while NVLink forwards to the experts' GPUs, the two links
    in parallel; two-micro-batch overlap hides ``comm_overlap`` of the shorter of compute and communication.
    """
    m, hw, eff = dep.model, dep.hw, dep.eff
    dense = 2.0 * m.dense_params_prefill
    experts = 2.0 * m.prefill_moe_layers * m.top_k * m.expert_params * expert_share  # the device's share
    attn = m.attention_flops(ctx, prefill=True)
    attn_dtype = "bf16" if m.kv_dtype == "bf16" else "fp8"

    def peak(d: str) -> float:
        if dep.untimed_compute and not hw.has_peak(PEAK_ORDER[d]):
            return math.inf  # FLOP/s not published (--memory-bound-only): compute not timed
        return hw.peak(d, PEAK_ORDER[d]) * eff.prefill_flop_efficiency

    t_flop = dense / peak(dep.dense_dtype) + experts / peak(dep.expert_dtype) + attn / peak(attn_dtype)
    scale_out, scale_up = prefill_link_bytes(m, dep.ep, hw.scaleup_domain)
    nic = hw.scaleout_bw or hw.scaleup_bw
    t_comm = max(scale_out / (nic * eff.eta_comm), scale_up / (hw.scaleup_bw * eff.eta_comm))
    t = max(t_flop, t_comm) + (1.0 - eff.comm_overlap) * min(t_flop, t_comm)
    return dense + experts + attn, t, "compute" if t_flop >= t_comm else "communication"


@dataclass(frozen=True)
class PrefillTiers:
    """Per prompt token, the time of the routed experts off the device (a machine's placement)."""

    chunk: int  # prompt tokens per prefill step
    experts_touched_per_layer: float  # of every tier, by one chunk
    device_expert_share: float  # share of the expert FLOPs the device computes
    t_host: float  # seconds per prompt token: CPU kernels (host path "cpu") or the link ("link")
    t_disk: float  # seconds per prompt token reading the touched disk experts
    host_path: str  # "cpu", "link" or "" (no host tier)
    host_bound: str  # under "cpu": "compute" or "memory" (which of the two set t_host)
    overlap: str  # "summed" or "overlapped"

    def combine(self, t_device: float, bound: str) -> tuple[float, str]:
        """Per-token time with the tiers, and the bound (the slowest part)."""
        parts = {bound: t_device, "disk": self.t_disk}
        if self.host_path:
            parts["host" if self.host_path == "cpu" else "link"] = self.t_host
        total = max(parts.values()) if self.overlap == "overlapped" else sum(parts.values())
        return total, max(parts, key=parts.get)

    def as_dict(self) -> dict[str, float | str | int]:
        return asdict(self)


def prefill_tiers(dep: Deployment) -> PrefillTiers | None:
    """The off-device experts' cost per prompt token (None without a placement on a machine)."""
    pl, machine, m, eff = dep.placement, dep.hw.machine, dep.model, dep.eff
    if pl is None or machine is None:
        return None
    chunk = pl.prefill_chunk
    touched = expected_distinct_experts(m.n_experts, m.top_k, chunk, m.routing_skew)
    per_expert = m.prefill_moe_layers * m.expert_params * WEIGHT_BYTES[dep.expert_dtype]  # every MoE layer's
    share = lambda n: touched * n / pl.n_experts  # noqa: E731 - touched experts in a tier of n, static placement
    t_disk = share(pl.disk) * per_expert / ((machine.disk_read_gbs or 0.0) * GB) / chunk if pl.disk else 0.0
    off = pl.host + pl.disk
    if machine.kind != "gpu" or not off:
        return PrefillTiers(chunk, touched, 1.0, 0.0, t_disk, "", "", pl.overlap)
    off_bytes = share(off) * per_expert
    if pl.host_compute == "gpu":
        t_link = off_bytes / (dep.hw.host_link_bw * eff.eta_comm) / chunk / dep.gpus
        return PrefillTiers(chunk, touched, 1.0, t_link, t_disk, "link", "", pl.overlap)
    f_off = off / pl.n_experts
    t_read = off_bytes / host_expert_rate(dep) / chunk
    flops = 2.0 * m.prefill_moe_layers * m.top_k * m.expert_params * f_off
    t_cpu = flops / (machine.expert_tflops * TERA * eff.eta_flop) if machine.expert_tflops else 0.0
    return PrefillTiers(chunk, touched, 1.0 - f_off, max(t_read, t_cpu), t_disk, "cpu",
                        "compute" if t_cpu > t_read else "memory", pl.overlap)


def prefill_terms(dep: Deployment, prompt_len: int, hit_rate: float, instance_gpus: int, first_step_s: float,
                  kv_transfer_bw: float) -> Prefill:
    """Prefill throughput and TTFT. ``kv_transfer_bw`` > 0 adds shipping the prompt's cache to decode GPUs."""
    m, hw, eff = dep.model, dep.hw, dep.eff
    uncached = prompt_len * (1.0 - hit_rate)
    ctx = prompt_len * (1.0 + hit_rate) / 2.0  # uncached rows attend the cached prefix plus half the rest
    tiers = prefill_tiers(dep)
    flops, t_tok, bound = _gpu_seconds(dep, ctx, tiers.device_expert_share if tiers else 1.0)
    if tiers is not None:
        t_tok, bound = tiers.combine(t_tok, bound)
    replay = 0.0
    if m.prefill_layers < m.n_layers and uncached > 0:
        window = max((a.window for a in m.attention), default=0)
        replay = 2.0 * (m.params_active_decode - m.params_active_prefill) * min(uncached, window)
    peak_mix = (math.inf if dep.untimed_compute and not hw.has_peak(PEAK_ORDER[dep.dense_dtype])
                else hw.peak(dep.dense_dtype, PEAK_ORDER[dep.dense_dtype]) * eff.eta_flop)
    gpu_s = uncached * t_tok + replay / peak_mix
    per_token = gpu_s / uncached if uncached else t_tok
    weights = (dep.dense_weight_bytes(m.dense_params_total, m.head_params + m.embed_params) / dep.tp
               + m.routed_params_total * WEIGHT_BYTES[dep.expert_dtype] / dep.gpus)
    t_weights = weights / (hw.hbm_bw * eff.eta_mem)  # one pass over the weights bounds a short prompt
    t_over = (m.prefill_layers * eff.layer_overhead_us + eff.pass_overhead_us) * 1e-6
    t_xfer = prompt_len * m.kv_bytes_per_token / kv_transfer_bw if kv_transfer_bw > 0 else 0.0
    ttft = max(gpu_s / instance_gpus, t_weights) + t_over + t_xfer + first_step_s
    if per_token <= 0.0:  # nothing timed: no FLOP/s and nothing off the device
        per_token, bound = 0.0, "not timed (the device lists no FLOP/s)"
    return Prefill(flops_per_token=flops, gpu_seconds_per_token=per_token,
                   tokens_per_s_per_gpu=1.0 / per_token if per_token else math.inf,
                   replay_flops_per_request=replay, ttft_s=ttft, bound=bound, tiers=tiers)
