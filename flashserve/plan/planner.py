"""Put the terms together: per-agent speed, throughput per GPU, TTFT, sessions that fit, cost.

Prefill accounting: with ``prefill_gpus`` = 0 prefill shares the decode GPUs and their layout (each decode
cycle also pays for the prompts of the requests that finish in it); otherwise a separate pool with its own
layout (``prefill_tp``/``prefill_ep``/``prefill_attention_dp``, by default EP over the whole pool) serves
prompts and caps the output rate when it cannot keep up. Throughput per GPU always divides by every GPU deployed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..config.sizes import parse_size
from .capacity import Capacity, capacity
from .dtypes import PEAK_ORDER, dense_dtype_for
from .errors import PlanError
from .hardware import Hardware, get_hardware
from .inputs import PlanInputs, validate
from .model_terms import NO_DRAFT, ModelTerms
from .models import resolve_model
from .prefill import Prefill, prefill_terms
from .roofline import DecodeStep, Deployment, decode_step
from .stacks import resolve_stack
from .tiers import ExpertPlacement, resolve_placement


@dataclass(frozen=True)
class Speculation:
    """What the drafter buys at this concurrency, and where it stops paying.

    The speculative step is the plain step plus three parts: the drafter's stages (their weights, rows and
    layer overheads), the extra verification rows the target runs (1 + drafted per sequence instead of 1),
    and the fixed per-step cost of speculation (``spec_step_overhead_us``). Speculation pays while
    AL / step_with > 1 / step_without; with a prefill share in the cycle the condition is the same, since
    both cycles carry the prompts of the same output tokens."""

    accept_length: float
    draft_tokens: int
    step_with_s: float
    step_without_s: float
    draft_stages_s: float  # the drafter's passes: bytes, FLOPs, traffic and layer overheads
    verification_rows_s: float  # the target over 1 + drafted rows instead of 1
    fixed_s: float  # spec_step_overhead_us: once per speculative step
    crossover_concurrency: int | None  # smallest concurrency where it no longer pays; None: pays up to checked_up_to
    checked_up_to: int  # the highest concurrency examined (sessions that fit)
    verification_kv_bytes: float = 0.0  # per GPU: window + selected entries the extra rows gather on their own

    @property
    def speedup(self) -> float:
        """Per-agent (and per-GPU) speed with the drafter over speed without it, at the same concurrency."""
        return self.accept_length * self.step_without_s / self.step_with_s

    @property
    def pays(self) -> bool:
        return self.speedup > 1.0

    def as_dict(self) -> dict[str, object]:
        return {"accept_length": self.accept_length, "draft_tokens": self.draft_tokens,
                "step_with_ms": self.step_with_s * 1e3, "step_without_ms": self.step_without_s * 1e3,
                "draft_stages_ms": self.draft_stages_s * 1e3, "verification_rows_ms": self.verification_rows_s * 1e3,
                "fixed_ms": self.fixed_s * 1e3, "verification_kv_bytes": self.verification_kv_bytes,
                "speedup": self.speedup, "pays": self.pays,
                "decode_tokens_per_s_per_agent_without": 1.0 / self.step_without_s,
                "crossover_concurrency": self.crossover_concurrency, "checked_up_to": self.checked_up_to}


def _speedup(dep: Deployment, al: float, concurrency: float, ctx: float) -> float:
    plain = decode_step(replace(dep, draft_tokens=0), concurrency, ctx).t_step
    return al * plain / decode_step(dep, concurrency, ctx).t_step


def crossover_concurrency(dep: Deployment, al: float, ctx: float, up_to: int) -> int | None:
    """Smallest concurrency (1..up_to) at which drafting no longer pays (speed-up <= 1): powers of two
    bracket it, bisection pins it; None when it pays at every power of two up to ``up_to`` and at up_to."""
    if dep.draft_tokens <= 0:
        return None
    lo, c = 0, 1
    while True:
        c = min(c, up_to)
        if _speedup(dep, al, c, ctx) <= 1.0:
            break
        if c == up_to:
            return None
        lo, c = c, c * 2
    hi = c
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _speedup(dep, al, mid, ctx) <= 1.0:
            hi = mid
        else:
            lo = mid
    return hi


def speculation_terms(dep: Deployment, al: float, concurrency: float, ctx: float, up_to: int) -> Speculation | None:
    """The speculative step split into its parts against the plain step (None without a drafter)."""
    if dep.draft_tokens <= 0 or dep.model.draft.kind == "none":
        return None
    with_ = decode_step(dep, concurrency, ctx)
    without = decode_step(replace(dep, draft_tokens=0), concurrency, ctx)
    # the target alone over 1 + drafted rows: the drafter removed, its rows kept
    verify = decode_step(replace(dep, model=replace(dep.model, draft=NO_DRAFT)), concurrency, ctx)
    return Speculation(
        accept_length=al, draft_tokens=dep.draft_tokens, step_with_s=with_.t_step, step_without_s=without.t_step,
        draft_stages_s=with_.t_step - verify.t_step - with_.t_spec_fixed,
        verification_rows_s=verify.t_step - without.t_step, fixed_s=with_.t_spec_fixed,
        crossover_concurrency=crossover_concurrency(dep, al, ctx, max(up_to, 1)), checked_up_to=max(up_to, 1),
        verification_kv_bytes=with_.bytes_kv_rows)


def cost_per_million(price_per_gpu_hour: float, gpus: int, tokens_per_s: float) -> float:
    """US$ per million tokens: $/GPU-hour × GPUs × 10⁶ / (3600 × tokens/s)."""
    if tokens_per_s <= 0:
        return float("inf")
    return price_per_gpu_hour * gpus * 1e6 / (3600.0 * tokens_per_s)


@dataclass(frozen=True)
class PlanResult:
    """Everything the planner concluded, with the terms it used."""

    inputs: PlanInputs
    deployment: Deployment
    step: DecodeStep
    prefill: Prefill
    capacity: Capacity
    context: float
    accept_length: float
    cycle_time_s: float  # decode step plus the co-located prefill share
    tokens_per_s_per_agent: float
    output_tokens_per_s: float  # whole deployment
    total_gpus: int
    prefill_limited: bool
    price_per_gpu_hour: float
    speculation: Speculation | None = None  # with a drafter: the step without it, the parts, the crossover
    prefill_pool: Deployment | None = None  # the separate prefill pool's layout; None: prefill on the decode GPUs

    @property
    def prefill_deployment(self) -> Deployment:
        """The GPUs and layout prompts are computed on: the prefill pool, or the decode deployment."""
        return self.prefill_pool or self.deployment

    @property
    def output_tokens_per_s_per_gpu(self) -> float:
        return self.output_tokens_per_s / self.total_gpus

    @property
    def decode_tokens_per_s_per_gpu(self) -> float:
        """Output tokens/s per decode GPU while decoding (no prefill share, no prefill cap)."""
        return self.inputs.concurrency * self.accept_length / self.step.t_step / self.deployment.gpus

    @property
    def total_tokens_per_s_per_gpu(self) -> float:
        """Prompt (cached or not) plus output tokens per GPU: InferenceX's ``tput_per_gpu``."""
        ratio = 1.0 + self.inputs.prompt_len / self.inputs.output_len
        return self.output_tokens_per_s_per_gpu * ratio

    @property
    def tokens_per_s_per_agent_without_speculation(self) -> float | None:
        """The same deployment and concurrency without the drafter: its step plus the same prefill share per
        output token (None without a drafter)."""
        if self.speculation is None:
            return None
        share = (self.cycle_time_s - self.step.t_step) / self.accept_length  # prefill time per output token
        return 1.0 / (self.speculation.step_without_s + share)

    @property
    def cost_per_million_output_tokens(self) -> float:
        return cost_per_million(self.price_per_gpu_hour, self.total_gpus, self.output_tokens_per_s)

    @property
    def cost_per_million_total_tokens(self) -> float:
        return cost_per_million(self.price_per_gpu_hour, 1, self.total_tokens_per_s_per_gpu)

    def misfit(self) -> list[str]:
        """Why the deployment cannot run as planned; empty when it fits (weights, sessions, host tables)."""
        return misfit_reasons(self.deployment, self.capacity, self.inputs.concurrency, self.context)

    @property
    def priced(self) -> bool:
        """False for a machine given no price (its cost figures are then None in :meth:`as_dict`)."""
        return self.deployment.hw.machine is None or self.inputs.cost_per_gpu_hour is not None

    def as_dict(self) -> dict[str, object]:
        """Machine-readable summary (the ``--json`` output)."""
        dep = self.deployment
        return {
            "model": dep.model.name, "hardware": dep.hw.name,
            "gpus": dep.gpus, "prefill_gpus": self.inputs.prefill_gpus, "total_gpus": self.total_gpus,
            "tp": dep.tp, "ep": dep.ep, "attention_dp": dep.dp,
            "prefill_tp": self.prefill_deployment.tp, "prefill_ep": self.prefill_deployment.ep,
            "prefill_attention_dp": self.prefill_deployment.dp,
            "weight_dtype": dep.expert_dtype, "dense_dtype": dep.dense_dtype, "kv_dtype": dep.model.kv_dtype,
            "concurrency": self.inputs.concurrency, "context": self.context,
            "accept_length": self.accept_length, "draft_tokens": dep.draft_tokens,
            "tokens_per_s_per_agent": self.tokens_per_s_per_agent,
            "output_tokens_per_s": self.output_tokens_per_s,
            "output_tokens_per_s_per_gpu": self.output_tokens_per_s_per_gpu,
            "total_tokens_per_s_per_gpu": self.total_tokens_per_s_per_gpu,
            "decode_tokens_per_s_per_gpu": self.decode_tokens_per_s_per_gpu,
            "step_time_ms": self.step.t_step * 1e3,
            "cycle_time_ms": self.cycle_time_s * 1e3,
            "bound": self.step.bound,
            "prefill_tokens_per_s_per_gpu": self.prefill.tokens_per_s_per_gpu,
            "ttft_ms": self.prefill.ttft_s * 1e3,
            "prefill_limited": self.prefill_limited,
            "sessions_fit": self.capacity.sessions_fit,
            "fits": not self.misfit(), "misfit": self.misfit(),
            "cost_per_gpu_hour": self.price_per_gpu_hour if self.priced else None,
            "cost_per_million_output_tokens": self.cost_per_million_output_tokens if self.priced else None,
            "cost_per_million_total_tokens": self.cost_per_million_total_tokens if self.priced else None,
            "efficiency_profile": dep.eff.name, "stack": dep.stack,
            "speculation": self.speculation.as_dict() if self.speculation else None,
            "step": self.step.as_dict(), "prefill": self.prefill.as_dict(), "capacity": self.capacity.as_dict(),
            **({"machine": machine_summary(dep), "decode_tiers": tier_summary(self)}
               if dep.hw.machine is not None else {}),
        }


def misfit_reasons(dep: Deployment, cap: Capacity, concurrency: int, ctx: float) -> list[str]:
    """Why ``dep`` cannot hold ``concurrency`` sessions at context ``ctx``: weights beyond the device's memory,
    more sessions than fit, engram tables beyond host memory (empty when it fits)."""
    machine = dep.hw.machine
    reasons = []
    if cap.kv_budget_bytes_per_gpu <= 0:
        usable = dep.hw.hbm_usable_bytes - cap.workspace_bytes_per_gpu
        if cap.host_table_bytes_in_device:
            reasons.append(f"the weights ({cap.weight_bytes_per_gpu / 1e9:,.1f} GB) and the engram tables "
                           f"({cap.host_table_bytes_in_device / 1e9:,.1f} GB) share the unified memory; "
                           f"{usable / 1e9:,.1f} GB is usable after the workspace")
        else:
            reasons.append(f"the weights need {cap.weight_bytes_per_gpu / 1e9:,.1f} GB per GPU; "
                           f"{usable / 1e9:,.1f} GB is usable after the workspace")
        if machine is not None:
            reasons[-1] += "; " + expert_advice(dep, cap, concurrency, ctx)
    elif concurrency > cap.sessions_fit:
        reasons.append(f"{concurrency:,} sessions at context {ctx:,.0f} need "
                       f"{cap.bytes_per_sequence / 1e9:,.3g} GB each; {cap.sessions_fit:,} fit in HBM")
        if machine is not None:
            reasons[-1] += _room_for_sessions(dep, cap, concurrency)
    if not cap.host_fits:
        if machine is not None and machine.host_memory_gib is None and cap.host_expert_bytes:
            reasons.append(f"{dep.placement.host} experts per layer ({cap.host_expert_bytes / 1e9:,.1f} GB) are "
                           f"placed in host memory and {machine.name} gives no host memory size: pass "
                           "--host-memory GIB")
        elif machine is not None and cap.host_expert_bytes:
            reasons.append(host_advice(dep, cap))
        elif machine is not None and machine.host_memory_gib is None:
            reasons.append(f"the engram tables ({cap.host_table_bytes / 1e9:,.3g} GB) live in host memory and "
                           f"{machine.name} gives no host memory size: pass --host-memory GIB")
        else:
            reasons.append(f"the host-memory tables ({cap.host_table_bytes / 1e9:,.0f} GB) exceed the host "
                           "memory of one scale-up domain" + (_tables_to_disk(dep) if machine is not None else ""))
    return reasons


def _tables_to_disk(dep: Deployment) -> str:
    """Where a machine's engram tables can go when its memory cannot hold them: the disk, as ds4 and colibri keep
    them (--engram-tables disk)."""
    if dep.tables_on_disk:
        return ""
    return (": keep them on disk with --engram-tables disk (each token's rows then read from it"
            + ("" if dep.hw.machine.disk_read_gbs is not None else "; give its read bandwidth with --disk-bandwidth "
               "GB/S") + ")")


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def expert_advice(dep: Deployment, cap: Capacity, concurrency: int, ctx: float) -> str:
    """What to move where when a machine's device memory cannot hold the weights: how many routed experts per
    layer the device holds beside everything else (and ``concurrency`` sessions at ``ctx``), and where the
    rest can go."""
    m, hw, machine = dep.model, dep.hw, dep.hw.machine
    assert machine is not None
    e = m.n_experts
    others = cap.weight_bytes_per_gpu - cap.routed_bytes_per_gpu
    sessions = math.ceil(concurrency / dep.dp) * cap.bytes_per_sequence
    room = hw.hbm_usable_bytes - cap.workspace_bytes_per_gpu - cap.host_table_bytes_in_device - others - sessions
    per = cap.routed_bytes_per_expert_per_gpu
    device = {"gpu": "each GPU", "unified": "the unified memory", "cpu": "host memory"}[machine.kind]
    if room < per:
        tables = cap.host_table_bytes_in_device
        return (f"the weights other than the routed experts ({_gb(others)}), "
                + (f"the engram tables ({_gb(tables)}), " if tables else "")
                + f"and {concurrency:,} session(s) at context {ctx:,.0f} ({sessions / 1e9:,.3g} GB) leave {device} "
                "no room for even one routed expert per layer: "
                + ("keep the engram tables on disk with --engram-tables disk, or " if tables else "")
                + "fewer concurrent requests, a shorter context, more memory or a smaller model")
    fit = min(int(room // per), e)
    rest = e - fit
    resident = dep.placement.resident if dep.placement else e
    head = (f"{resident} routed experts per layer are {_gb(cap.routed_bytes_per_gpu)} of it and {device} holds "
            f"{fit} of the {e} per layer ({_gb(fit * per)}) beside the other weights and {concurrency:,} session(s)")
    rest_bytes = rest * per * dep.gpus
    if machine.kind != "gpu":
        return (f"{head}: keep {fit} per layer with --resident-experts {fit}; the other {rest} per layer "
                f"({_gb(rest_bytes)}) are then read from disk" + _disk_note(machine))
    if machine.host_memory_gib is None:
        return (f"{head}: keep {fit} per layer on the GPU with --resident-experts {fit} and put the other {rest} "
                f"({_gb(rest_bytes)}) in host memory (give its size with --host-memory GIB)")
    host_room = hw.host_mem_bytes * min(dep.gpus, hw.scaleup_domain) - cap.host_table_bytes
    in_host = max(min(int(host_room // (per * dep.gpus)), rest), 0)
    if in_host >= rest:
        return (f"{head}: keep {fit} per layer on the GPU with --resident-experts {fit}; the other {rest} per "
                f"layer ({_gb(rest_bytes)}) then go to host memory")
    return (f"{head}, and host memory holds {in_host} more per layer beside the engram tables: "
            f"--resident-experts {fit} --host-experts {in_host} reads the other {rest - in_host} per layer "
            f"({_gb((rest - in_host) * per * dep.gpus)}) from disk" + _disk_note(machine))


def _room_for_sessions(dep: Deployment, cap: Capacity, concurrency: int) -> str:
    """On a machine: how many resident experts per layer to move off the device to make room for the sessions."""
    per = cap.routed_bytes_per_expert_per_gpu
    resident = dep.placement.resident if dep.placement else dep.model.n_experts
    need = math.ceil(concurrency / dep.dp) * cap.bytes_per_sequence - cap.kv_budget_bytes_per_gpu
    move = math.ceil(need / per) if per > 0 else resident + 1
    if move > resident:
        return ""
    where = "host memory" if dep.hw.machine.kind == "gpu" else "disk"
    return (f"; moving {move} routed experts per layer off the device (--resident-experts {resident - move}, "
            f"the others to {where}) makes room for them")


def _disk_note(machine) -> str:
    return "" if machine.disk_read_gbs is not None else " (give the disk's read bandwidth with --disk-bandwidth GB/S)"


def host_advice(dep: Deployment, cap: Capacity) -> str:
    """Why the host memory of a machine cannot hold the experts placed in it, and how many it holds."""
    hw, pl, machine = dep.hw, dep.placement, dep.hw.machine
    assert pl is not None and machine is not None
    total = hw.host_mem_bytes * min(dep.gpus, hw.scaleup_domain)
    per = cap.host_expert_bytes / pl.host
    room = total - cap.host_table_bytes
    fit = max(min(int(room // per), pl.host), 0)
    tables = f" beside the engram tables ({_gb(cap.host_table_bytes)})" if cap.host_table_bytes else ""
    return (f"{pl.host} experts per layer in host memory need {_gb(cap.host_expert_bytes)}; host memory "
            f"({_gb(total)}) holds {fit} per layer{tables}: --resident-experts {pl.resident} --host-experts {fit} reads the other "
            f"{pl.disk + pl.host - fit} per layer from disk" + _disk_note(machine))


def speed_gaps(dep: Deployment) -> list[str]:
    """Why a machine's speed cannot be predicted: the GEMM dtypes its device has no FLOP/s for (nor one to
    fall back on), with what its description says was not published. Empty when it can (and for datacenter
    presets)."""
    m = dep.hw.machine
    if m is None or dep.untimed_compute:
        return []
    attn = "bf16" if dep.model.kv_dtype == "bf16" else "fp8"
    needed = dict.fromkeys((dep.dense_dtype, dep.expert_dtype, attn))
    missing = [d for d in needed if not dep.hw.has_peak(PEAK_ORDER[d])]
    if not missing:
        return []
    where = "host.expert_tflops" if m.kind == "cpu" else "gpu.tflops"
    notes = [f"{k}: {v}" for k, v in m.not_published.items() if k.startswith(where)]
    have = ", ".join(f"{d} {v:g}" for d, v in m.device_tflops.items()) or "none"
    device = "CPU" if m.kind == "cpu" else "GPU"
    return [f"no FLOP/s for the {'/'.join(missing)} GEMMs on the {device} of {m.name} (TFLOP/s given: {have})"
            + (f"; not published: {'; '.join(notes)}" if notes else "") + f"; give {where} in a machine file, or "
            "time the step by memory alone with --memory-bound-only (an upper bound on speed)"]


def machine_summary(dep: Deployment) -> dict[str, object]:
    """A machine's fields as given, and what the planner does and does not do with them."""
    assert dep.hw.machine is not None
    return {**dep.hw.machine.as_dict(), "planned": machine_planned(dep), "not_planned": machine_not_planned(dep),
            "placement": dep.placement.as_dict() if dep.placement else None}


def machine_planned(dep: Deployment) -> list[str]:
    """What a plan on a machine covers, in words."""
    m, pl = dep.hw.machine, dep.placement
    assert m is not None
    where = {"gpu": f"in the memory of {dep.gpus} GPU{'s' if dep.gpus > 1 else ''}",
             "unified": "in the unified memory", "cpu": "in host memory, computed by the CPU (as on cpu-local)"}
    if pl is None:
        out = [f"every weight and the KV cache {where[m.kind]}"]
    else:
        out = [(f"attention, dense and shared weights, the drafter, the KV cache and {pl.resident} of the "
                f"{pl.n_experts} routed experts of each layer {where[m.kind]}")]
        if pl.host:
            out.append(f"{pl.host} routed experts per layer in host memory, " + (
                "computed by CPU expert kernels at host bandwidth" if pl.host_compute == "cpu"
                else "moved over the GPU link when selected and computed on the GPU"))
        if pl.disk:
            out.append(f"{pl.disk} routed experts per layer read from disk when selected (no cache credited), "
                       "then computed as " + ("the host-memory experts are" if m.kind == "gpu"
                                              else "the resident experts are"))
        if pl.hit_rate is None:
            out.append("a selected expert is in a tier with probability (its experts per layer) / "
                       f"{pl.n_experts} (a static placement of experts whichever they are)")
        elif pl.hit_source in ("lru", "lfu"):
            how = "Che's approximation" if pl.hit_source == "lru" else "the most used experts' share"
            out.append(f"the resident experts are an {pl.hit_source.upper()} cache: a selected expert is in it with "
                       f"probability {pl.hit_rate:.3g} (the routing's skew, {how}); a miss is in host memory or on "
                       "disk in proportion to their experts")
        else:
            out.append(f"a selected expert is resident with the measured hit rate {pl.hit_rate:.3g}; a miss is in "
                       "host memory or on disk in proportion to their experts")
        out.append("the tiers' times are " + ("summed (each layer waits for its experts)" if pl.overlap == "summed"
                                              else "overlapped (the step takes its slowest tier)"))
        out.append(f"prefill in chunks of {pl.prefill_chunk} prompt tokens, each touching most experts of a layer: the "
                   "off-device experts are computed by the CPU, moved over the link or read from disk once a chunk")
    if m.kind == "cpu" and m.expert_gbs:
        out.append(f"the routed experts read by the CPU's expert kernels at their measured {m.expert_gbs:g} GB/s "
                   "(host.expert_gbs), after the dense work on the same cores")
    if dep.model.host_params and dep.tables_on_disk:
        out.append("engram tables on disk: each decode token's rows read from it (bytes at the disk's read "
                   "bandwidth, and one read per row at its IOPS, each where given)")
    elif dep.model.host_params:
        out.append({"gpu": "engram rows read from host memory over the GPU's link",
                    "unified": "engram tables in the same unified memory, counted against it",
                    "cpu": "engram tables in the same host memory"}[m.kind])
    fitted = ", ".join(dep.eff.fitted_on)
    out.append(f"efficiency terms of profile {dep.eff.name}: " + (
        f"fitted on {fitted}" if fitted else "priors, fitted on no published point for this machine"))
    return out


def machine_not_planned(dep: Deployment) -> list[str]:
    """What a plan on a machine leaves out, in words."""
    m, pl = dep.hw.machine, dep.placement
    assert m is not None
    cpu_used = pl is not None and m.kind == "gpu" and pl.host + pl.disk > 0 and pl.host_compute == "cpu"
    unused = [label for label, given in (
        ("host bandwidth", m.kind == "gpu" and m.host_bandwidth_gbs is not None and not cpu_used),
        ("CPU cores", m.cpu_cores is not None),
        ("CPU expert-kernel throughput", m.kind != "cpu" and m.expert_tflops is not None and not cpu_used),
        ("disk read bandwidth", m.disk_read_gbs is not None and not (pl and pl.disk)),
        ("disk IOPS", m.disk_iops is not None)) if given]
    out = []
    if pl is None:
        out.append("experts in host memory or on disk: none placed there (--resident-experts, --host-experts "
                   "place them; docs/plan.md section 2)")
    else:
        if m.kind == "gpu" and pl.host + pl.disk and pl.host_compute == "cpu" and m.expert_tflops is None:
            out.append("the CPU's expert-kernel FLOP/s (host.expert_tflops): prefill's CPU experts are timed by one "
                       "read of host memory per chunk only, a lower bound on their time")
        if pl.hit_rate is None:
            out.append("a measured hit rate of an engine's expert cache (--expert-hit-rate): the resident experts "
                       "are a static set, not the most used")
    if dep.tables_on_disk and (m.disk_read_gbs is None or m.disk_iops is None):
        missing = " and ".join(x for x, v in (("read bandwidth", m.disk_read_gbs), ("IOPS", m.disk_iops)) if v is None)
        out.append(f"the disk's {missing}: the engram rows read from disk are timed without "
                   f"{'them' if ' and ' in missing else 'it'} (about {dep.model.host_row_bytes_per_token / 1e3:.0f} KB "
                   f"in {dep.model.host_reads_per_token:.0f} reads a token)")
    if dep.untimed_compute:
        out.append("the device's compute: its FLOP/s are not given, so the step is timed by memory, disk and "
                   "links alone (--memory-bound-only: an upper bound on speed)")
    out.append("dense layers or the KV cache in host memory")
    if unused:
        out.append(f"{', '.join(unused)}: read from the description, not used by the prediction")
    return out


def tier_summary(r: PlanResult) -> dict[str, object]:
    """Per decode step on a machine: each tier's contents, bytes read, bandwidth and time, and the bottleneck.
    The device tier's time is its whole roofline body (memory, compute and links combined); the fixed
    per-layer and per-pass time is its own row."""
    dep, s = r.deployment, r.step
    m, pl = dep.hw.machine, dep.placement
    assert m is not None
    tokens = r.inputs.concurrency * r.accept_length  # output tokens per step, the whole machine
    t_body = s.t_device
    resident = pl.resident if pl else dep.model.n_experts
    name = {"gpu": "GPU memory", "unified": "unified memory", "cpu": "host memory"}[m.kind]
    cpu_kernels = m.kind == "cpu" and bool(m.expert_gbs)  # every expert timed at the CPU kernels' rate
    holds = (f"{resident} of {dep.model.n_experts} routed experts per layer" if not cpu_kernels
             else "the routed experts (timed in their own row)")
    rows = [{"tier": name, "holds": f"attention, dense and shared weights, KV cache, {holds}",
             "bytes_per_step": s.bytes_total * dep.gpus,
             "bandwidth_gbs": dep.hw.hbm_bw / 1e9, "efficiency": dep.eff.eta_mem, "time_ms": t_body * 1e3,
             "work": f"reads at bandwidth x eta_mem, with compute and links (step {s.bound}-bound overall)"}]
    if pl is not None and m.kind == "gpu" and (pl.host or pl.disk):
        cpu = pl.host_compute == "cpu"
        rows.append({"tier": "host memory", "holds": f"{pl.host} routed experts per layer"
                     + (f" (and the {pl.disk} per layer paged in from disk)" if pl.disk else ""),
                     "bytes_per_step": s.bytes_host_experts,
                     "bandwidth_gbs": (m.host_bandwidth_gbs if cpu else dep.hw.host_link_bw / 1e9),
                     "efficiency": dep.eff.host_mem_efficiency if cpu else dep.eff.eta_comm, "time_ms": s.t_host * 1e3,
                     "work": ("CPU expert kernels at host bandwidth x eta_host_mem (eta_mem without one)" + (
                         " (FLOPs at host.expert_tflops x eta_flop, the slower of the two)" if m.expert_tflops
                         else "; host.expert_tflops not given: the CPU's FLOPs are not timed")) if cpu
                     else "moved over the GPU link at link bandwidth x eta_comm"})
    if cpu_kernels:
        rows.append({"tier": "CPU expert kernels", "holds": f"{resident} of {dep.model.n_experts} routed experts "
                     "per layer in host memory" + (f", {pl.disk} paged in from disk" if pl and pl.disk else ""),
                     "bytes_per_step": s.bytes_host_experts, "bandwidth_gbs": m.expert_gbs, "efficiency": 1.0,
                     "time_ms": s.t_host * 1e3,
                     "work": "read at the kernels' measured host.expert_gbs" + (
                         " (FLOPs at host.expert_tflops x eta_flop, the slower of the two)" if m.expert_tflops
                         else "")})
    if pl is not None and pl.disk:
        rows.append({"tier": "disk", "holds": f"{pl.disk} routed experts per layer",
                     "bytes_per_step": s.bytes_disk_experts, "bandwidth_gbs": m.disk_read_gbs, "efficiency": 1.0,
                     "time_ms": s.t_disk * 1e3, "work": "read at the disk's stated bandwidth"})
    rows.append({"tier": "fixed", "holds": "", "bytes_per_step": 0.0, "bandwidth_gbs": None, "efficiency": None,
                 "time_ms": s.t_overhead * 1e3, "work": "layers x layer overhead + passes x pass overhead"})
    for row in rows:
        row["bytes_per_token"] = row["bytes_per_step"] / tokens
    top = max(rows, key=lambda row: row["time_ms"])
    return {"tiers": rows, "combined": pl.overlap if pl else "summed", "step_time_ms": s.t_step * 1e3, "bottleneck": top["tier"],
            "decode_tokens_per_s_per_agent": r.accept_length / s.t_step,
            "placement": pl.as_dict() if pl else None}


def build_deployment(inp: PlanInputs, model: ModelTerms | None = None, hw: Hardware | None = None) -> Deployment:
    """Check the inputs and place the model on the hardware."""
    validate(inp)
    model = model or resolve_model(inp.model, inp.kv_dtype)
    if inp.routing_skew is not None:
        model = replace(model, routing_skew=inp.routing_skew)
    hw = hw or get_hardware(inp.hardware, overrides=inp.hardware_overrides)
    if hw.machine is not None:
        _check_machine(inp, hw)
    draft = inp.resolved_draft_tokens(model.draft.block)
    if draft and model.draft.kind == "none":
        raise PlanError("--accept-length", f"{model.name} has no drafter; speculative decoding needs one")
    if inp.accept_length > draft + 1:
        raise PlanError("--accept-length", f"{inp.accept_length} exceeds draft tokens + 1 = {draft + 1}")
    if inp.tp > hw.scaleup_domain:
        raise PlanError("--tp", f"TP {inp.tp} spans more than one {hw.scaleup_domain}-GPU scale-up domain")
    # a stack is the default only where it was measured: datacenter presets (a machine may share a name)
    stack = resolve_stack(inp.stack, model.family, hw.name if hw.machine is None else "")
    eff = hw.efficiency.with_overrides(**{**(stack.terms if stack else {}), **inp.overrides})
    tables_on_disk = _tables_on_disk(inp, model, hw)
    if inp.memory_bound_only and hw.machine is None:
        raise PlanError("--memory-bound-only", f"is for a machine whose device lists no FLOP/s; the datacenter "
                        f"preset {hw.name} lists them")
    if inp.head_dtype is not None and not model.head_params:
        raise PlanError("--head-dtype", f"{model.name}'s terms do not separate its LM head (V4 and V4.1 do)")
    dep = Deployment(model=model, hw=hw, eff=eff, gpus=inp.gpus, tp=inp.tp, ep=inp.resolved_ep(),
                     dp=inp.resolved_dp(), expert_dtype=inp.weight_dtype,
                     dense_dtype=dense_dtype_for(inp.weight_dtype), draft_tokens=draft,
                     stack=stack.name if stack else None, placement=None, tables_on_disk=tables_on_disk,
                     untimed_compute=inp.memory_bound_only, head_dtype=_head_dtype(inp, model))
    resident, host, cache = inp.resident_experts, inp.host_experts, inp.expert_cache
    if inp.gpu_experts is not None:
        resident = _gpu_experts(inp, model, hw)
    if inp.weight_memory is not None:
        resident, tables_on_disk = _budget_placement(dep, parse_size(inp.weight_memory))
        if resident is None:
            _nothing_off_the_device(inp)
        elif cache is None and inp.expert_hit_rate is None:
            cache = "lru"  # the engine's slots: LRU unless told lfu (or a measured hit rate replaces it)
    placement = resolve_placement(resident, host, inp.host_expert_compute,
                                  model.n_experts, hw.machine.kind if hw.machine else None, hw.name,
                                  inp.expert_hit_rate, inp.tier_overlap, inp.prefill_chunk, cache,
                                  model.top_k, model.routing_skew, inp.concurrency * (1 + draft))
    if placement is not None:
        _check_tiers(placement, hw)
    return replace(dep, placement=placement, tables_on_disk=tables_on_disk)


def _head_dtype(inp: PlanInputs, model: ModelTerms) -> str | None:
    """``--head-dtype``; under the engine's own options (--gpu-experts, --weight-memory) the bf16 the engine holds a
    released V4/V4.1 head and embeddings in, where the model separates them."""
    if inp.head_dtype is None and model.head_params and (inp.gpu_experts is not None or inp.weight_memory is not None):
        return "bf16"
    return inp.head_dtype


def _nothing_off_the_device(inp: PlanInputs) -> None:
    """A ``--weight-memory`` that holds every weight places nothing: the flags about placed experts do not apply."""
    for flag, value in (("--expert-cache", inp.expert_cache), ("--expert-hit-rate", inp.expert_hit_rate),
                        ("--tier-overlap", inp.tier_overlap), ("--host-expert-compute", inp.host_expert_compute)):
        if value is not None:
            raise PlanError(flag, f"--weight-memory {inp.weight_memory} holds every weight: no expert is off the "
                            "device for it to apply to (leave it out)")


def _gpu_experts(inp: PlanInputs, model: ModelTerms, hw: Hardware) -> int:
    """``--gpu-experts N`` (the engine's hybrid option): N routed experts per layer on the GPU of a discrete-GPU
    machine, a fixed set, the others in host memory computed by the CPU's expert kernels."""
    n = inp.gpu_experts
    for flag, value, why in (("--host-expert-compute", inp.host_expert_compute, "the engine's hybrid computes "
                              "the others on the CPU"),
                             ("--expert-cache", inp.expert_cache, "the engine's hybrid holds a fixed set")):
        if value is not None:
            raise PlanError(flag, f"does not apply with --gpu-experts: {why}")
    if hw.machine is None or hw.machine.kind != "gpu":
        where = ("a datacenter preset keeps every expert in GPU memory" if hw.machine is None
                 else f"{hw.name} is a {hw.machine.kind} machine, with no discrete GPU: use --weight-memory")
        raise PlanError("--gpu-experts", f"splits the routed experts between a discrete GPU and the CPU; {where}")
    if n > model.n_experts:
        raise PlanError("--gpu-experts", f"{n} exceeds the {model.n_experts} routed experts of each layer")
    return n


ROW_SHARE = 16  # of what the other weights leave, the engine's engram row caches take a sixteenth (model.loader)


def _budget_placement(dep: Deployment, budget: int) -> tuple[int | None, bool]:
    """``--weight-memory`` (the engine's resident budget for the weights) on a machine without a discrete GPU, split
    as the engine splits it: the weights other than the routed experts and the engram tables held whole, a
    sixteenth of the rest for the engram tables' row caches (the tables then on disk: cached rows not credited), the
    remainder in slots of routed experts per layer, the others read from disk. Returns the experts per layer held
    (None: every one) and whether the engram tables are on disk."""
    hw, m = dep.hw, dep.model
    if hw.machine is None or hw.machine.kind == "gpu":
        where = ("a datacenter preset" if hw.machine is None
                 else f"{hw.name} has a discrete GPU (the engine's --weight-memory and --gpu-experts do not combine): "
                      "use --gpu-experts")
        raise PlanError("--weight-memory", f"budgets the memory of a machine without a discrete GPU; {where}")
    cap = capacity(dep, 1.0)  # its weight bytes (the KV cache is checked with the plan)
    per = cap.routed_bytes_per_expert_per_gpu
    experts = cap.routed_bytes_per_gpu
    fixed = cap.weight_bytes_per_gpu - experts
    tables = 0.0 if dep.tables_on_disk else m.host_params * (1.0 + 1.0 / 32)
    if budget >= fixed + experts + tables:
        return None, dep.tables_on_disk
    need = fixed + per * m.top_k
    if budget < need:
        raise PlanError("--weight-memory", f"{budget / 2**30:.2f} GiB cannot hold the weights other than the routed "
                        f"experts ({fixed / 2**30:.2f} GiB) and {m.top_k} experts a layer ({per / 2**30:.3f} GiB an "
                        f"expert in every layer): give at least {need / 2**30:.2f} GiB")
    left = budget - fixed
    rows = min(left / ROW_SHARE, tables)  # the row caches, at most the whole tables (which then stay in memory)
    slots = int((left - rows) // per)
    if slots >= m.n_experts:  # every expert held: the tables take the rest, whole or from disk
        return None, dep.tables_on_disk or left - experts < tables
    return slots, dep.tables_on_disk or rows < tables


def _tables_on_disk(inp: PlanInputs, model: ModelTerms, hw: Hardware) -> bool:
    """``--engram-tables disk``, checked: a machine, a model with tables, a disk bandwidth to read them at."""
    if inp.engram_tables in (None, "memory"):
        return False
    if hw.machine is None:
        raise PlanError("--engram-tables", f"places the tables on a machine's disk; on the datacenter preset "
                        f"{hw.name} they are in host memory")
    if not model.host_params:
        raise PlanError("--engram-tables", f"{model.name} has no engram tables")
    return True


def _check_tiers(pl: ExpertPlacement, hw: Hardware) -> None:
    """A tier that holds experts needs the bandwidth it is read at."""
    m = hw.machine
    assert m is not None
    if pl.disk and m.disk_read_gbs is None:
        raise PlanError("--disk-bandwidth", f"{pl.disk} experts per layer are read from disk and {m.name} gives no "
                        "disk read bandwidth: pass --disk-bandwidth GB/S, or disk.read_gbs in a machine file")
    if (m.kind == "gpu" and pl.host + pl.disk and pl.host_compute == "cpu" and m.host_bandwidth_gbs is None
            and m.expert_gbs is None):
        raise PlanError("--host-bandwidth", f"the CPU computes {pl.host + pl.disk} experts per layer from host "
                        f"memory and {m.name} gives no host bandwidth: pass --host-bandwidth GB/S, or host.channels "
                        "and host.mts (or the CPU expert kernels' measured host.expert_gbs) in a machine file")


def _check_machine(inp: PlanInputs, hw: Hardware) -> None:
    """A machine holds as many devices as it has, and needs its memory size to be planned."""
    m = hw.machine
    assert m is not None
    total = inp.gpus + inp.prefill_gpus
    if total > m.devices:
        what = f"{m.devices} GPU{'s' if m.devices > 1 else ''}" if m.kind != "cpu" else "no GPU (one CPU device)"
        flag = "--prefill-gpus" if inp.prefill_gpus and inp.gpus <= m.devices else "--gpus"
        raise PlanError(flag, f"{m.name} has {what}; the deployment asks for {total}")
    if m.device_memory_gib is None:
        raise PlanError("--host-memory", f"{m.name} gives no memory size (a server's depends on the memory "
                        "fitted): pass --host-memory GIB, or host.memory_gib in a machine file")


def prefill_pool(inp: PlanInputs, dep: Deployment) -> Deployment | None:
    """The separate prefill pool: the decode deployment's model, dtypes and efficiency on its own GPUs and
    layout (None when prefill shares the decode GPUs)."""
    if inp.prefill_gpus <= 0:
        return None
    tp = inp.resolved_prefill_tp()
    if tp > dep.hw.scaleup_domain:
        raise PlanError("--prefill-tp", f"TP {tp} spans more than one {dep.hw.scaleup_domain}-GPU scale-up domain")
    return replace(dep, gpus=inp.prefill_gpus, tp=tp, ep=inp.resolved_prefill_ep(), dp=inp.resolved_prefill_dp())


def plan(inp: PlanInputs, model: ModelTerms | None = None, hw: Hardware | None = None) -> PlanResult:
    """Run the planner on ``inp`` (``model``/``hw`` may be passed to skip the lookups)."""
    dep = build_deployment(inp, model, hw)
    ctx = inp.resolved_context()
    step = decode_step(dep, inp.concurrency, ctx)
    pool = prefill_pool(inp, dep)
    disagg = pool is not None
    xfer = (dep.hw.scaleout_bw or dep.hw.scaleup_bw) * dep.eff.eta_comm if disagg else 0.0
    pre = prefill_terms(pool or dep, inp.prompt_len, inp.prefix_hit_rate, inp.prefill_gpus or inp.gpus,
                        step.t_step, xfer)
    uncached = inp.prompt_len * (1.0 - inp.prefix_hit_rate)
    al = inp.accept_length
    if disagg:
        cycle = step.t_step
        out = inp.concurrency * al / cycle
        limit = inp.prefill_gpus * pre.tokens_per_s_per_gpu * inp.output_len / uncached if uncached else float("inf")
        limited = out > limit
        out = min(out, limit)
    else:
        finished = inp.concurrency * al / inp.output_len  # requests completing per cycle
        cycle = step.t_step + finished * uncached * pre.gpu_seconds_per_token / inp.gpus
        out, limited = inp.concurrency * al / cycle, False
    price = inp.cost_per_gpu_hour if inp.cost_per_gpu_hour is not None else dep.hw.cost_per_gpu_hour
    cap = capacity(dep, ctx)
    return PlanResult(
        inputs=inp, deployment=dep, step=step, prefill=pre, capacity=cap, context=ctx,
        accept_length=al, cycle_time_s=cycle, tokens_per_s_per_agent=al / cycle, output_tokens_per_s=out,
        total_gpus=inp.gpus + inp.prefill_gpus, prefill_limited=limited, price_per_gpu_hour=price,
        speculation=speculation_terms(dep, al, inp.concurrency, ctx, cap.sessions_fit), prefill_pool=pool,
    )
