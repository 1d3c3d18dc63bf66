"""Every term and assumption behind one plan, as rows (for ``--explain`` tables and JSON)."""

from __future__ import annotations

import textwrap
from typing import Iterator

from .planner import PlanResult
from .stacks import NO_STACK, get_stack

Row = tuple[str, str, str, str]  # section, term, value, note / source


def _g(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".strip()


def _model_rows(r: PlanResult) -> Iterator[Row]:
    m, dep = r.deployment.model, r.deployment
    yield "model", "name / family", f"{m.name} / {m.family}", "; ".join(m.notes)
    yield "model", "parameters (backbone)", _g(m.params_total), "host-memory tables excluded"
    yield "model", "active per decode token", _g(m.params_active_decode), f"{m.n_moe_layers} MoE layers × top-{m.top_k} of {m.n_experts}"
    yield "model", "active per prompt token", _g(m.params_active_prefill), f"{m.prefill_layers} layers per prompt token"
    yield "model", "global KV per token", _g(m.kv_bytes_per_token, "B"), f"KV dtype {m.kv_dtype}"
    yield "model", "bounded state per sequence", _g(m.state_bytes_per_sequence, "B"), "window rings (do not grow with context)"
    yield "model", "KV bytes read per sequence per step", _g(m.kv_read_bytes(r.context), "B"), f"at context {r.context:,.0f}"
    yield "model", "drafter", f"{m.draft.kind}, {dep.draft_tokens} drafted/step", f"{m.draft.passes(dep.draft_tokens)} pass(es) of {m.draft.layers} layer(s)"
    if m.host_params:
        yield "model", "host tables (engram)", _g(r.capacity.host_table_bytes, "B"), "fits host memory" if r.capacity.host_fits else "DOES NOT fit host memory"


def _hardware_rows(r: PlanResult) -> Iterator[Row]:
    hw, src = r.deployment.hw, r.deployment.hw.sources
    p = f"presets.{hw.name}."
    yield "hardware", "HBM usable", _g(hw.hbm_usable_bytes, "B"), src.get(p + "hbm_usable_bytes", "")
    yield "hardware", "HBM bandwidth", _g(hw.hbm_bw, "B/s"), src.get(p + "hbm_bw", "")
    for d, v in hw.flops.items():
        yield "hardware", f"{d} dense peak", _g(v, "FLOP/s"), src.get(p + f"flops.{d}", "")
    yield "hardware", "scale-up link", f"{_g(hw.scaleup_bw, 'B/s')} × {hw.scaleup_domain} GPUs", src.get(p + "scaleup_bw", "")
    yield "hardware", "scale-out link", _g(hw.scaleout_bw, "B/s"), src.get(p + "scaleout_bw", "")
    if r.priced:
        yield "hardware", "price", f"${r.price_per_gpu_hour:.2f} / GPU-hour", src.get(p + "cost_per_gpu_hour", "") if r.inputs.cost_per_gpu_hour is None else "--cost-per-gpu-hour"
    else:
        yield "hardware", "price", "not priced", src.get(p + "cost_per_gpu_hour", "")
    eff = r.deployment.eff
    yield _stack_row(r)
    stack_src: dict[str, str] = {}
    if r.deployment.stack is not None:
        stack = get_stack(r.deployment.stack, r.deployment.model.family)
        stack_src = {k: f"stack {stack.name}: {v}" for k, v in stack.sources.items()}
    terms = ["eta_mem", "eta_flop", "eta_comm", "layer_overhead_us", "pass_overhead_us", "comm_overlap",
             "workspace_fraction"]
    if r.speculation is not None or eff.spec_step_overhead_us:
        terms.insert(5, "spec_step_overhead_us")
    if eff.eta_host_mem is not None:
        terms.insert(1, "eta_host_mem")
    for term in terms:
        note = "override" if term in r.inputs.overrides else stack_src.get(
            term, src.get(f"efficiency.{eff.name}.{term}", "not measured for this stack: 0 (prior)"))
        yield "efficiency", term, f"{getattr(eff, term):.4g}", note
    if eff.eta_flop_prefill is not None or "eta_flop_prefill" in r.inputs.overrides:
        note = "override" if "eta_flop_prefill" in r.inputs.overrides else src.get(
            f"efficiency.{eff.name}.eta_flop_prefill", "")
        yield "efficiency", "eta_flop_prefill", f"{eff.prefill_flop_efficiency:.4g}", note


def _machine_rows(r: PlanResult) -> Iterator[Row]:
    """A machine's fields as its description gave them (with their sources) and what the plan covers."""
    from .planner import machine_not_planned, machine_planned

    m = r.deployment.hw.machine
    if m is None:
        return
    d = m.as_dict()
    yield "machine", "name / kind", f"{m.name} / {m.kind}", f"{m.description} (from {m.origin})".strip()
    for section in ("gpu", "host", "link", "disk"):
        for key, value in (d.get(section) or {}).items():
            if key == "tflops":
                for dtype, tf in value.items():
                    path = f"gpu.tflops.{dtype}"
                    yield "machine", path, f"{tf:g}", m.sources.get(path, "")
                continue
            path = f"{section}.{key}"
            text = f"{value:,.4g}" if isinstance(value, float) else str(value)
            yield "machine", path, text, m.sources.get(path, "")
    for path, why in m.not_published.items():
        yield "machine", path, "not published", why
    for text in machine_planned(r.deployment):
        yield "machine", "planned", "", text
    for text in machine_not_planned(r.deployment):
        yield "machine", "not planned", "", text


def _tier_rows(r: PlanResult) -> Iterator[Row]:
    """A machine's decode step by tier: what each holds, bytes per output token, bandwidth, time; the
    bottleneck."""
    from .planner import tier_summary

    if r.deployment.hw.machine is None:
        return
    t = tier_summary(r)
    for row in t["tiers"]:
        if row["tier"] == "fixed":
            yield "tiers", "fixed time", f"{row['time_ms']:.3f} ms", row["work"]
            continue
        bw = f"at {row['bandwidth_gbs']:,.4g} GB/s x {row['efficiency']:.3g}: " if row["bandwidth_gbs"] else ""
        yield "tiers", f"{row['tier']}: bytes per token", _g(row["bytes_per_token"], "B"), row["holds"]
        yield "tiers", f"{row['tier']}: time", f"{row['time_ms']:.3f} ms", f"{bw}{row['work']}"
    summed = t["combined"] == "summed"
    yield ("tiers", f"step time (tiers {t['combined']})", f"{t['step_time_ms']:.3f} ms",
           f"bottleneck: {t['bottleneck']}; " + ("a single decode stream waits for each tier in turn" if summed
                                                 else "the tiers run at once: the slowest sets the step"))
    pt = r.prefill.tiers
    if pt is not None:
        who = {"cpu": f"CPU kernels ({pt.host_bound}-bound)", "link": "moved over the GPU link", "": "none"}[pt.host_path]
        yield ("tiers", "prefill: off-device experts", f"{(pt.t_host + pt.t_disk) * 1e6:,.1f} us/token",
               f"chunks of {pt.chunk} tokens touch {pt.experts_touched_per_layer:,.1f} experts a layer; host "
               f"{pt.t_host * 1e6:,.1f} us ({who}), disk {pt.t_disk * 1e6:,.1f} us, {pt.overlap}")


def _stack_row(r: PlanResult) -> Row:
    """Which serving-stack profile the efficiency terms come from, and how far to trust it."""
    name = r.deployment.stack
    if name is None:
        off = "--stack none given" if r.inputs.stack == NO_STACK else "no stack measured for this model here"
        return "efficiency", "serving stack", "none", f"{off}: hardware profile {r.deployment.eff.name} only"
    stack = get_stack(name, r.deployment.model.family)
    how = "--stack" if r.inputs.stack == name else f"default for {r.deployment.model.family}; --stack none: off"
    n = len(stack.fitted_on)
    count = "one published point" if n == 1 else f"{n} published points"
    return ("efficiency", "serving stack", name,
            f"{how}. {stack.description}. Its {' and '.join(stack.terms)} "
            f"{'was' if len(stack.terms) == 1 else 'were'} fitted on {count} only "
            f"({', '.join(stack.fitted_on)}); held out: {', '.join(stack.held_out) or 'none'} "
            "(docs/plan.md section 3)")


def _step_rows(r: PlanResult) -> Iterator[Row]:
    s, dep = r.step, r.deployment
    pre = r.prefill_deployment
    yield "layout", "decode GPUs / TP / EP / attention DP", f"{dep.gpus} / {dep.tp} / {dep.ep} / {dep.dp}", ""
    yield ("layout", "prefill GPUs / TP / EP / attention DP", f"{pre.gpus} / {pre.tp} / {pre.ep} / {pre.dp}",
           "separate pool (--prefill-gpus), its own layout (--prefill-tp, --prefill-ep, --prefill-attention-dp)"
           if r.prefill_pool else "shared: prefill runs on the decode GPUs and their layout")
    yield "layout", "dtypes experts / dense / KV", f"{dep.expert_dtype} / {dep.dense_dtype} / {dep.model.kv_dtype}", ""
    yield "step", "sequences per attention rank", f"{s.sequences_per_rank:.4g}", f"{s.rows_per_sequence} rows each (1 + drafted)"
    how = (f"Σ 1−(1−qᵢ)^B, qᵢ ∝ i^-{dep.model.routing_skew:g}" if dep.model.routing_skew
           else "E·(1−(1−k/E)^B), uniform")
    yield "step", "distinct experts per layer", f"{s.distinct_experts_per_layer:.4g}", how + "; all rows of the step"
    yield "step", "bytes: dense weights", _g(s.bytes_dense, "B"), "per GPU: dense / TP"
    yield "step", "bytes: routed experts", _g(s.bytes_experts, "B"), "distinct experts × expert bytes / GPUs" + (
        " × resident fraction (the rest: [tiers])" if dep.placement is not None else "")
    yield "step", "bytes: KV read", _g(s.bytes_kv, "B"), "per local sequence: index scan once, window + selected entries per query row"
    yield "step", "bytes: drafter", _g(s.bytes_draft, "B"), ""
    yield "step", "FLOPs dense / experts / attention / drafter", " / ".join(_g(x) for x in (s.flops_dense, s.flops_experts, s.flops_attention, s.flops_draft)), "per GPU"
    yield "step", "link bytes EP / TP / host", " / ".join(_g(x, "B") for x in (s.comm_bytes_ep, s.comm_bytes_tp, s.comm_bytes_host)), f"EP over {s.comm_link}"
    yield "step", "t_mem / t_flop / t_comm", " / ".join(f"{x * 1e3:.3f} ms" for x in (s.t_mem, s.t_flop, s.t_comm)), "roofline terms"
    yield "step", "t_overhead", f"{s.t_overhead * 1e3:.3f} ms", "layers × layer overhead + passes × pass overhead" + (
        " + the fixed speculative-step cost" if s.t_spec_fixed else "")
    yield "step", "step time", f"{s.t_step * 1e3:.3f} ms", f"{s.bound}-bound; cycle with prefill share {r.cycle_time_s * 1e3:.3f} ms"


def _speculation_rows(r: PlanResult) -> Iterator[Row]:
    s = r.speculation
    if s is None:
        return
    ms = lambda x: f"{x * 1e3:.3f} ms"  # noqa: E731
    yield "speculation", "step without drafting", ms(s.step_without_s), "the target over one row per sequence"
    yield "speculation", "+ verification rows", ms(s.verification_rows_s), f"the target over {1 + s.draft_tokens} rows per sequence instead of 1"
    if s.verification_kv_bytes:
        bw = r.deployment.hw.hbm_bw * r.deployment.eff.eta_mem
        yield ("speculation", "  of which KV gathered per row", _g(s.verification_kv_bytes, "B"),
               f"{s.verification_kv_bytes / bw * 1e3:.3f} ms of HBM time, hidden when compute-bound: each "
               "verification row gathers its own window and top-k entries (sparse attention selects per "
               "query row); the index scan is read once per sequence")
    yield "speculation", "+ draft stages", ms(s.draft_stages_s), "the drafter's passes: weights, rows, traffic, layer overheads"
    yield "speculation", "+ fixed per step", ms(s.fixed_s), "spec_step_overhead_us: once per step whatever the batch"
    yield "speculation", "step with drafting", ms(s.step_with_s), f"acceptance length {s.accept_length:g}"
    yield "speculation", "speed-up over no drafting", f"{s.speedup:.2f}x", "AL × step without / step with (per agent and per GPU)"
    where = (f"from concurrency {s.crossover_concurrency:,} (step without × AL <= step with)"
             if s.crossover_concurrency else f"pays at every concurrency up to the {s.checked_up_to:,} sessions that fit")
    yield "speculation", "drafting stops paying", f"{s.crossover_concurrency:,}" if s.crossover_concurrency else "never", where


def _output_rows(r: PlanResult) -> Iterator[Row]:
    yield "output", "tokens/s per agent", f"{r.tokens_per_s_per_agent:,.1f}", f"acceptance length {r.accept_length:g} / cycle"
    yield "output", "output tokens/s per GPU", f"{r.output_tokens_per_s_per_gpu:,.1f}", f"over {r.total_gpus} GPUs" + (" (prefill-limited)" if r.prefill_limited else "")
    yield "output", "prompt+output tokens/s per GPU", f"{r.total_tokens_per_s_per_gpu:,.1f}", "InferenceX tput_per_gpu convention"
    yield "output", "prefill tokens/s per GPU", f"{r.prefill.tokens_per_s_per_gpu:,.0f}", f"{r.prefill.bound}-bound, uncached tokens"
    yield "output", "TTFT (idle)", f"{r.prefill.ttft_s * 1e3:,.1f} ms", f"prompt {r.inputs.prompt_len:,}, hit rate {r.inputs.prefix_hit_rate:g}"
    fits = r.inputs.concurrency <= r.capacity.sessions_fit
    yield "output", "sessions that fit", f"{r.capacity.sessions_fit:,}", f"at context {r.context:,.0f}; concurrency {r.inputs.concurrency:,} " + ("fits" if fits else "DOES NOT fit")
    if r.priced:
        yield "output", "$ per million output tokens", f"{r.cost_per_million_output_tokens:.4g}", "$/GPU-h × GPUs × 1e6 / (3600 × output tokens/s)"
    else:
        yield "output", "$ per million output tokens", "not priced", "a machine has no price; --cost-per-gpu-hour gives one"


def explain_rows(r: PlanResult) -> list[Row]:
    """All rows, inputs first, outputs last."""
    return [*_model_rows(r), *_machine_rows(r), *_hardware_rows(r), *_step_rows(r), *_tier_rows(r),
            *_speculation_rows(r), *_output_rows(r)]


def explain_lines(r: PlanResult, width: int = 80) -> list[str]:
    """The rows as text no wider than ``width``: a heading per section, ``term  value`` on one line and
    the note or source wrapped and indented beneath it."""
    lines = textwrap.wrap(f"flashserve plan: {r.deployment.model.name} on {r.deployment.gpus}x "
                          f"{r.deployment.hw.name}", width)
    section = None
    for sec, term, value, note in explain_rows(r):
        if sec != section:
            lines += ["", f"[{sec}]"]
            section = sec
        head = f"  {term}"
        gap = width - len(head) - len(value)
        lines += [head + " " * max(gap, 2) + value] if gap >= 2 else textwrap.wrap(
            f"{head}: {value}", width, subsequent_indent="      ")
        if note:
            lines += textwrap.wrap(note, width, initial_indent="      ", subsequent_indent="      ",
                                   break_long_words=True, break_on_hyphens=False)
    return lines


def print_explain(r: PlanResult) -> None:
    """Print every term for an 80-column terminal."""
    print("\n".join(explain_lines(r)))
