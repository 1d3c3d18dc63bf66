"""Put the terms together: per-agent speed, throughput per GPU, TTFT, sessions that fit, cost.

Prefill accounting: with ``prefill_gpus`` = 0 prefill shares the decode GPUs and their layout (each decode
cycle also pays for the prompts of the requests that finish in it); otherwise a separate pool with its own
layout (``prefill_tp``/``prefill_ep``/``prefill_attention_dp``, by default EP over the whole pool) serves
prompts and caps the output rate when it cannot keep up. Throughput per GPU always divides by every GPU deployed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
            **({"machine": machine_summary(dep)} if dep.hw.machine is not None else {}),
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
            reasons[-1] += ("; the planner keeps every weight in the memory of the device that computes and "
                            "does not yet place experts in host memory or on disk")
    elif concurrency > cap.sessions_fit:
        reasons.append(f"{concurrency:,} sessions at context {ctx:,.0f} need "
                       f"{cap.bytes_per_sequence / 1e9:,.3g} GB each; {cap.sessions_fit:,} fit in HBM")
    if not cap.host_fits:
        if machine is not None and machine.host_memory_gib is None:
            reasons.append(f"the engram tables ({cap.host_table_bytes / 1e9:,.3g} GB) live in host memory and "
                           f"{machine.name} gives no host memory size: pass --host-memory GIB")
        else:
            reasons.append(f"the host-memory tables ({cap.host_table_bytes / 1e9:,.0f} GB) exceed the host "
                           "memory of one scale-up domain")
    return reasons


def speed_gaps(dep: Deployment) -> list[str]:
    """Why a machine's speed cannot be predicted: the GEMM dtypes its device has no FLOP/s for (nor one to
    fall back on), with what its description says was not published. Empty when it can (and for datacenter
    presets)."""
    m = dep.hw.machine
    if m is None:
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
            + (f"; not published: {'; '.join(notes)}" if notes else "") + f"; give {where} in a machine file"]


def machine_summary(dep: Deployment) -> dict[str, object]:
    """A machine's fields as given, and what the planner does and does not do with them."""
    assert dep.hw.machine is not None
    return {**dep.hw.machine.as_dict(), "planned": machine_planned(dep), "not_planned": machine_not_planned(dep)}


def machine_planned(dep: Deployment) -> list[str]:
    """What a plan on a machine covers, in words."""
    m = dep.hw.machine
    assert m is not None
    where = {"gpu": f"in the memory of {dep.gpus} GPU{'s' if dep.gpus > 1 else ''}",
             "unified": "in the unified memory", "cpu": "in host memory, computed by the CPU (as on cpu-local)"}
    out = [f"every weight and the KV cache {where[m.kind]}"]
    if dep.model.host_params:
        out.append({"gpu": "engram rows read from host memory over the GPU's link",
                    "unified": "engram tables in the same unified memory, counted against it",
                    "cpu": "engram tables in the same host memory"}[m.kind])
    fitted = ", ".join(dep.eff.fitted_on)
    out.append(f"efficiency terms of profile {dep.eff.name}: " + (
        f"fitted on {fitted}" if fitted else "priors, fitted on no published point for this machine"))
    return out


def machine_not_planned(dep: Deployment) -> list[str]:
    """What a plan on a machine leaves out, in words."""
    m = dep.hw.machine
    assert m is not None
    unused = [label for label, given in (
        ("host bandwidth", m.kind == "gpu" and m.host_bandwidth_gbs is not None),
        ("CPU cores", m.cpu_cores is not None),
        ("CPU expert-kernel throughput", m.kind != "cpu" and m.expert_tflops is not None),
        ("disk read bandwidth", m.disk_read_gbs is not None), ("disk IOPS", m.disk_iops is not None)) if given]
    out = [{"gpu": "experts or dense layers in host memory or streamed from disk, and CPU expert kernels beside "
                   "the GPU",
            "unified": "experts streamed from disk, and CPU expert kernels beside the GPU",
            "cpu": "experts streamed from disk"}[m.kind] + ": the planner does not place weights across tiers yet"]
    if unused:
        out.append(f"{', '.join(unused)}: read from the description, not used by the prediction")
    return out


def build_deployment(inp: PlanInputs, model: ModelTerms | None = None, hw: Hardware | None = None) -> Deployment:
    """Check the inputs and place the model on the hardware."""
    validate(inp)
    model = model or resolve_model(inp.model, inp.kv_dtype)
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
    return Deployment(model=model, hw=hw, eff=eff, gpus=inp.gpus, tp=inp.tp, ep=inp.resolved_ep(),
                      dp=inp.resolved_dp(), expert_dtype=inp.weight_dtype,
                      dense_dtype=dense_dtype_for(inp.weight_dtype), draft_tokens=draft,
                      stack=stack.name if stack else None)


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
