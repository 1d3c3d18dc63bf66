"""Prefill: GPU-seconds per prompt token at large batch, and the time to first token of one request.

V4.1 runs only its encoder per prompt token (≈ active-prefill parameters) and replays the decoder on the
last ``sliding_window`` rows; V3/V4 run every layer per prompt token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .dispatch import prefill_link_bytes
from .dtypes import PEAK_ORDER, WEIGHT_BYTES
from .roofline import Deployment


@dataclass(frozen=True)
class Prefill:
    """Prefill terms (per GPU unless named otherwise)."""

    flops_per_token: float
    gpu_seconds_per_token: float  # one GPU's time per prompt token at large batch
    tokens_per_s_per_gpu: float
    replay_flops_per_request: float  # V4.1 decoder replay on the last window rows
    ttft_s: float  # one request on an idle instance, first decode step included
    bound: str

    def as_dict(self) -> dict[str, float | str]:
        return asdict(self)


def _gpu_seconds(dep: Deployment, ctx: float) -> tuple[float, float, str]:
    """(FLOPs per prompt token, GPU-seconds per token, bound) for a prompt attending ``ctx`` keys on average.

    Compute runs at the profile's prefill efficiency; dispatch/combine crosses the scale-out network once per
    remote node (:mod:`flashserve.plan.dispatch`) while NVLink forwards to the experts' GPUs, the two links
    in parallel; two-micro-batch overlap hides ``comm_overlap`` of the shorter of compute and communication.
    """
    m, hw, eff = dep.model, dep.hw, dep.eff
    dense = 2.0 * m.dense_params_prefill
    experts = 2.0 * m.prefill_moe_layers * m.top_k * m.expert_params
    attn = m.attention_flops(ctx, prefill=True)
    attn_dtype = "bf16" if m.kv_dtype == "bf16" else "fp8"

    def peak(d: str) -> float:
        return hw.peak(d, PEAK_ORDER[d]) * eff.prefill_flop_efficiency

    t_flop = dense / peak(dep.dense_dtype) + experts / peak(dep.expert_dtype) + attn / peak(attn_dtype)
    scale_out, scale_up = prefill_link_bytes(m, dep.ep, hw.scaleup_domain)
    nic = hw.scaleout_bw or hw.scaleup_bw
    t_comm = max(scale_out / (nic * eff.eta_comm), scale_up / (hw.scaleup_bw * eff.eta_comm))
    t = max(t_flop, t_comm) + (1.0 - eff.comm_overlap) * min(t_flop, t_comm)
    return dense + experts + attn, t, "compute" if t_flop >= t_comm else "communication"


def prefill_terms(dep: Deployment, prompt_len: int, hit_rate: float, instance_gpus: int, first_step_s: float,
                  kv_transfer_bw: float) -> Prefill:
    """Prefill throughput and TTFT. ``kv_transfer_bw`` > 0 adds shipping the prompt's cache to decode GPUs."""
    m, hw, eff = dep.model, dep.hw, dep.eff
    uncached = prompt_len * (1.0 - hit_rate)
    ctx = prompt_len * (1.0 + hit_rate) / 2.0  # uncached rows attend the cached prefix plus half the rest
    flops, t_tok, bound = _gpu_seconds(dep, ctx)
    replay = 0.0
    if m.prefill_layers < m.n_layers and uncached > 0:
        window = max((a.window for a in m.attention), default=0)
        replay = 2.0 * (m.params_active_decode - m.params_active_prefill) * min(uncached, window)
    peak_mix = hw.peak(dep.dense_dtype, PEAK_ORDER[dep.dense_dtype]) * eff.eta_flop
    gpu_s = uncached * t_tok + replay / peak_mix
    per_token = gpu_s / uncached if uncached else t_tok
    weights = (m.dense_params_total * WEIGHT_BYTES[dep.dense_dtype] / dep.tp
               + m.routed_params_total * WEIGHT_BYTES[dep.expert_dtype] / dep.gpus)
    t_weights = weights / (hw.hbm_bw * eff.eta_mem)  # one pass over the weights bounds a short prompt
    t_over = (m.prefill_layers * eff.layer_overhead_us + eff.pass_overhead_us) * 1e-6
    t_xfer = prompt_len * m.kv_bytes_per_token / kv_transfer_bw if kv_transfer_bw > 0 else 0.0
    ttft = max(gpu_s / instance_gpus, t_weights) + t_over + t_xfer + first_step_s
    return Prefill(flops_per_token=flops, gpu_seconds_per_token=per_token, tokens_per_s_per_gpu=1.0 / per_token,
                   replay_flops_per_request=replay, ttft_s=ttft, bound=bound)
