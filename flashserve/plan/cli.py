"""``flashserve plan``: command-line front end of the planner.

``register(subparsers)`` adds the ``plan`` subcommand to a parent argparse parser (its handler is stored as
``func`` and returns an exit code); ``main(argv)`` runs it standalone (``python -m flashserve.plan``).
Actions: ``run`` (default), ``sweep``, ``published``, ``seed``, ``verdict``. Bad input exits with code 2 and
one line naming the field. ``--hardware`` takes a preset or a machine JSON file (checked before any work);
``--gpu-memory``, ``--host-memory`` and the like set a machine's fields over its preset or file;
``--resident-experts``, ``--host-experts`` and ``--host-expert-compute`` place a machine's routed experts across
device memory, host memory and disk, ``--expert-cache``, ``--expert-hit-rate`` and ``--tier-overlap`` say how an
engine's cache and prefetching serve them (:mod:`flashserve.plan.tiers`); ``--routing-skew`` sets how unevenly
the router uses its experts.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from ..cli_help import HelpFormatter
from .errors import PlanError
from .hardware import get_hardware, hardware_name, preset_names
from .inputs import PlanInputs
from .machine import OVERRIDE_FIELDS

ACTIONS = ("run", "sweep", "published", "seed", "verdict")
# the machine flags: flag key -> (metavar, help)
MACHINE_FLAGS = {
    "gpu_memory": ("GIB", "memory of each GPU, GiB"),
    "gpu_bandwidth": ("GB/S", "memory bandwidth of each GPU, GB/s"),
    "host_memory": ("GIB", "host memory, GiB (the unified memory on a unified machine)"),
    "host_bandwidth": ("GB/S", "host memory bandwidth, GB/s (replaces channels x MT/s)"),
    "disk_bandwidth": ("GB/S", "disk read bandwidth, GB/s"),
}
assert set(MACHINE_FLAGS) == set(OVERRIDE_FIELDS)
OVERRIDE_FLAGS = ("eta_mem", "eta_flop", "eta_flop_prefill", "eta_comm", "layer_overhead_us", "pass_overhead_us",
                  "spec_step_overhead_us", "comm_overlap")
DESCRIPTION = ("Predict per-agent decode speed, throughput per GPU, TTFT, sessions that fit and cost per "
               "million tokens for a DeepSeek-V3/V4/V4.1 deployment, from a roofline with every term visible.")


class _Given(argparse.Action):
    """Mixin of the planner's store actions: also records that the flag was given (``namespace.given``), so a
    fixed scenario can refuse a flag even when its value equals the default."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        if option_string is not None:
            namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


class _StoreGiven(_Given, argparse._StoreAction):
    pass


class _StoreTrueGiven(_Given, argparse._StoreTrueAction):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The planner's flags (shared by ``register`` and ``main``)."""
    p.register("action", None, _StoreGiven)
    p.register("action", "store", _StoreGiven)
    p.register("action", "store_true", _StoreTrueGiven)
    p.set_defaults(given=frozenset())
    p.add_argument("action", nargs="?", default="run", choices=ACTIONS,
                   help="run (default): one plan; sweep: concurrency curve as JSON + PNG; published: predicted vs "
                        "published points; seed: the V4.1 GB300 headline; verdict: the 1M tok/s and $0.002/M claims")
    p.add_argument("--model", default="deepseek-v41-flash", help="preset or config.json path (deepseek_v3/v4/v41)")
    p.add_argument("--hardware", default="gb300-nvl72",
                   help=f"hardware preset: {', '.join(preset_names())} (any case, or a unique prefix: gb300, "
                        "H200), or a machine JSON file (docs/plan.md section 2)")
    for key, (metavar, text) in MACHINE_FLAGS.items():
        p.add_argument("--" + key.replace("_", "-"), type=float, default=None, metavar=metavar,
                       help=f"{text}: set on a machine preset or file (not on a datacenter preset)")
    p.add_argument("--resident-experts", type=int, default=None, metavar="N",
                   help="routed experts per MoE layer kept in the memory of the device that computes, on a machine "
                        "(default: all); beside a discrete GPU the rest go to host memory unless --host-experts "
                        "is given, on a unified or GPU-less machine to disk")
    p.add_argument("--host-experts", type=int, default=None, metavar="N",
                   help="routed experts per MoE layer in host memory beside a discrete GPU; with "
                        "--resident-experts, the rest are read from disk")
    p.add_argument("--host-expert-compute", default=None, choices=("cpu", "gpu"),
                   help="who computes the host-memory experts: cpu (default: CPU expert kernels at host "
                        "bandwidth) or gpu (moved over the GPU link)")
    p.add_argument("--expert-hit-rate", type=float, default=None, metavar="H",
                   help="measured fraction (0-1) of selected experts found resident, as an engine's expert cache "
                        "reports it (default: the uniform prior, resident experts / experts per layer); the misses "
                        "split over host memory and disk by their experts")
    p.add_argument("--expert-cache", default=None, choices=("static", "lru", "lfu"),
                   help="what the resident experts are: static (default: a fixed set, hit in proportion to their "
                        "count), lru (an LRU cache of the selected experts, as ds4's dynamic expert cache and "
                        "flashserve's --weight-memory keep them) or lfu (flashserve's --expert-cache-policy lfu: "
                        "the most used); a cache's hit rate follows from --routing-skew")
    p.add_argument("--gpu-experts", type=int, default=None, metavar="N",
                   help="the engine's hybrid option on a discrete-GPU machine: N routed experts per layer on the "
                        "GPU, the others in host memory computed by the CPU's expert kernels (as --resident-experts "
                        "N)")
    p.add_argument("--weight-memory", default=None, metavar="SIZE",
                   help="the engine's resident budget for the weights (e.g. 96GiB) on a machine without a discrete "
                        "GPU: split as the engine splits it (the other weights whole, a sixteenth of the rest for "
                        "engram row caches with the tables on disk, then slots of routed experts per layer in an "
                        "LRU cache, --expert-cache lfu for the engine's lfu), the other experts read from disk")
    p.add_argument("--tier-overlap", default=None, choices=("summed", "overlapped"),
                   help="how the tiers' times combine in a step: summed (default: each layer waits for its "
                        "experts) or overlapped (the slowest tier: engines that prefetch or run CPU and GPU at "
                        "once)")
    p.add_argument("--engram-tables", default=None, choices=("memory", "disk"),
                   help="where V4.1's engram tables live on a machine: memory (default: host memory beside a GPU, "
                        "else the unified or host memory) or disk (each token's rows read from disk, as ds4 and "
                        "colibri keep them)")
    p.add_argument("--memory-bound-only", action="store_true",
                   help="on a machine whose device lists no FLOP/s (Apple, AMD unified parts): time the step by its "
                        "memory, disk and links only, an upper bound on speed (decode at low concurrency)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="TOKENS",
                   help="prompt tokens per prefill step where experts are off the device: each chunk reads or moves "
                        "the experts it touches once (llama.cpp's -ub, default 512; vLLM's --max-num-batched-tokens)")
    p.add_argument("--gpus", type=int, default=8,
                   help="decode GPUs (all GPUs when prefill is co-located; a machine's own GPU count unless "
                        "given)")
    p.add_argument("--tp", type=int, default=1, help="attention tensor parallelism")
    p.add_argument("--ep", type=int, default=None, help="expert parallelism (default: --gpus)")
    p.add_argument("--attention-dp", type=int, default=None, help="attention data-parallel ranks (default: gpus/tp)")
    p.add_argument("--prefill-gpus", type=int, default=0, help="separate prefill GPUs (0: prefill shares the GPUs)")
    p.add_argument("--prefill-tp", type=int, default=None,
                   help="prefill pool's attention tensor parallelism (default 1; needs --prefill-gpus)")
    p.add_argument("--prefill-ep", type=int, default=None,
                   help="prefill pool's expert parallelism (default: --prefill-gpus)")
    p.add_argument("--prefill-attention-dp", type=int, default=None,
                   help="prefill pool's attention data-parallel ranks (default: prefill-gpus/prefill-tp)")
    p.add_argument("--weight-dtype", default="fp4", type=str.lower,
                   help="routed-expert dtype: fp4 (MXFP4), fp8, bf16, fp32, or a 2-/3-bit width as the local ports "
                        "name it: q2_k (2.625 bits per weight), q3_k (3.4375), 3.0bpw, iq2_xxs-q2_k (2.25, ds4's "
                        "Q2 file); dense weights stay FP8 "
                        "beside fp4 and the 2-/3-bit widths")
    p.add_argument("--head-dtype", default=None, choices=("fp8", "bf16", "fp32"),
                   help="the LM head and token embeddings' storage, where it differs from the other dense weights "
                        "(V4/V4.1: the released checkpoint keeps them bf16, and flashserve reads them so, also in "
                        "float32; default: the dense weights' dtype, or bf16 with --gpu-experts/--weight-memory)")
    p.add_argument("--kv-dtype", default=None, help="cache dtype: fp4, fp8, bf16 (default: model native)")
    p.add_argument("--routing-skew", type=float, default=None, metavar="S",
                   help="how unevenly the router uses its experts: the i-th most used is selected in proportion "
                        "to i^-S (default: the model's, 0.88 for V4 and V4.1 from V4-Flash's measured routing, 0 "
                        "for V3/R1; give 0 for random router weights, which route uniformly); sets the distinct "
                        "experts a step reads")
    p.add_argument("--concurrency", type=int, default=1, help="sequences decoding at once")
    p.add_argument("--context", type=int, default=None, help="mean KV length while decoding (default prompt + output/2)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=1024, help="output tokens per request")
    p.add_argument("--accept-length", type=float, default=1.0, help="mean tokens accepted per step (bonus included)")
    p.add_argument("--draft-tokens", type=int, default=None, help="drafted tokens per step (default: the drafter's block)")
    p.add_argument("--prefix-hit-rate", type=float, default=0.0, help="fraction of prompt tokens from the prefix cache")
    p.add_argument("--cost-per-gpu-hour", type=float, default=None, help="US$ (default: the preset's)")
    p.add_argument("--stack", default=None,
                   help="serving-stack profile over the hardware's (hardware.json 'stacks'); default: the stack "
                        "measured for the model on that hardware (V4.1 on GPUs), 'none' for the hardware profile alone")
    for flag in OVERRIDE_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=float, default=None,
                       help=f"override efficiency term {flag} (default: the hardware profile's)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--explain", action="store_true", help="print every term and assumption")
    p.add_argument("--levels", default=None, help="sweep: comma-separated concurrencies")
    p.add_argument("--out", default="plan-sweep", help="sweep: output path prefix (writes PREFIX.json and PREFIX.png)")
    p.add_argument("--calibrate", metavar="BENCH.json|SWEEP_DIR", default=None,
                   help="fit efficiency terms to a measured bench sweep (a JSON file or a bench sweep --out folder) and report held-out error")
    p.add_argument("--fit", default="eta_mem,eta_flop,layer_overhead_us", help="calibrate: comma-separated terms")
    p.add_argument("--allow-misfit", action="store_true",
                   help="print speed and cost even for a deployment that does not fit (marked as such)")


# Flags each fixed-scenario action honours; any other flag given to it is refused rather than ignored.
ACTION_FLAGS = {"published": {"json"}, "seed": {"json"}, "verdict": {"json", "model", "hardware"}}


def _inputs(a: argparse.Namespace) -> PlanInputs:
    overrides = {k: getattr(a, k) for k in OVERRIDE_FLAGS if getattr(a, k) is not None}
    return PlanInputs(
        model=a.model, hardware=a.hardware, gpus=a.gpus, tp=a.tp, ep=a.ep, attention_dp=a.attention_dp,
        prefill_gpus=a.prefill_gpus, prefill_tp=a.prefill_tp, prefill_ep=a.prefill_ep,
        prefill_attention_dp=a.prefill_attention_dp, weight_dtype=a.weight_dtype, kv_dtype=a.kv_dtype,
        concurrency=a.concurrency,
        context=a.context, prompt_len=a.prompt_len, output_len=a.output_len, accept_length=a.accept_length,
        draft_tokens=a.draft_tokens, prefix_hit_rate=a.prefix_hit_rate, cost_per_gpu_hour=a.cost_per_gpu_hour,
        overrides=overrides, stack=a.stack, hardware_overrides=_machine_overrides(a),
        resident_experts=getattr(a, "resident_experts", None), host_experts=getattr(a, "host_experts", None),
        host_expert_compute=getattr(a, "host_expert_compute", None),
        expert_hit_rate=getattr(a, "expert_hit_rate", None), tier_overlap=getattr(a, "tier_overlap", None),
        expert_cache=getattr(a, "expert_cache", None), routing_skew=getattr(a, "routing_skew", None),
        gpu_experts=getattr(a, "gpu_experts", None), weight_memory=getattr(a, "weight_memory", None),
        prefill_chunk=getattr(a, "prefill_chunk", 512), engram_tables=getattr(a, "engram_tables", None),
        memory_bound_only=bool(getattr(a, "memory_bound_only", False)), head_dtype=getattr(a, "head_dtype", None))


def _machine_overrides(a: argparse.Namespace) -> dict[str, float]:
    return {k: getattr(a, k) for k in MACHINE_FLAGS if getattr(a, k, None) is not None}


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(flag, f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise PlanError(flag, "needs at least one concurrency, each >= 1")
    return values


def _summary(d: dict[str, object]) -> str:
    return (_machine_text(d.get("machine")) + _summary_core(d) + _tiers_text(d.get("decode_tiers"))
            + _speculation_summary(d.get("speculation")))


def _tiers_text(t: dict[str, object] | None) -> str:
    """A machine's decode step by tier: bytes per token and time, and the bottleneck."""
    if not t:
        return ""
    lines = [f"\n  decode tiers ({t.get('combined', 'summed')}; bottleneck {t['bottleneck']})"]
    for row in t["tiers"]:
        bytes_ = f"{row['bytes_per_token'] / 1e9:8.3f} GB/token" if row["bytes_per_step"] else " " * 17
        lines.append(f"    {row['tier']:22} {bytes_}  {row['time_ms']:9.3f} ms")
    return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:,.1f}".rstrip("0").rstrip(".") if x < 1000 else f"{x:,.0f}"


def _machine_text(m: dict[str, object] | None, width: int = 80) -> str:
    """A machine's description as loaded, and what the plan does and does not do with it."""
    if not m:
        return ""
    gpu, host, link, disk = (m.get(k) or {} for k in ("gpu", "host", "link", "disk"))
    rows = []
    if gpu:
        flops = " / ".join(f"{d.upper()} {_num(v)}" for d, v in gpu.get("tflops", {}).items())
        parts = [f"{gpu.get('count', 1)} x {gpu.get('model') or 'GPU'}"]
        parts += [f"{_num(gpu['memory_gib'])} GiB"] if "memory_gib" in gpu else []
        parts += [f"{_num(gpu['bandwidth_gbs'])} GB/s"] if "bandwidth_gbs" in gpu else []
        parts += [f"{flops} TFLOP/s dense" if flops else "TFLOP/s not given"]
        rows.append(("GPU", ", ".join(parts)))
    host_parts = [host.get("cpu", "")] if host.get("cpu") else []
    host_parts.append(f"{_num(host['memory_gib'])} GiB" if "memory_gib" in host else "memory size not given")
    if "bandwidth_gbs" in host:
        how = f" ({host['channels']} channels x {_num(host['mts'])} MT/s)" if "channels" in host else ""
        host_parts.append(f"{_num(host['bandwidth_gbs'])} GB/s{how}")
    host_parts += [f"{host['cpu_cores']} CPU cores"] if "cpu_cores" in host else []
    host_parts += [f"expert kernels {_num(host['expert_tflops'])} TFLOP/s"] if "expert_tflops" in host else []
    rows.append(("host" + (" (unified)" if m.get("unified") else ""), ", ".join(host_parts)))
    if link:
        pcie = f"PCIe {link['pcie_gen']}.0 x{link['lanes']}, " if "pcie_gen" in link else ""
        rows.append(("link", f"{pcie}{link['bandwidth_gbs']:,.1f} GB/s per direction"))
    disk_parts = [f"{_num(disk['read_gbs'])} GB/s read"] if "read_gbs" in disk else []
    disk_parts += [f"{disk['iops']:,.0f} IOPS"] if "iops" in disk else []
    rows.append(("disk", ", ".join(disk_parts) or "not given"))
    rows += [("planned", text) for text in m.get("planned", [])]
    rows += [("not planned", text) for text in m.get("not_planned", [])]
    rows += [("not published", f"{k}: {v}") for k, v in (m.get("not_published") or {}).items()]
    lines = [f"machine {m['name']} ({m['kind']}, from {m['origin']})"]
    for label, text in rows:
        lines += textwrap.wrap(text, width, initial_indent=f"  {label:15} ", subsequent_indent=" " * 18)
    return "\n".join(lines) + "\n"


def _speculation_summary(s: dict[str, object] | None) -> str:
    """Both curves' point at this concurrency and where drafting stops paying."""
    if not s:
        return ""
    stop = (f"from concurrency {s['crossover_concurrency']:,}" if s["crossover_concurrency"]
            else f"never up to the {s['checked_up_to']:,} sessions that fit")
    return (f"\n  without drafting          {s['decode_tokens_per_s_per_agent_without']:,.1f} tokens/s per agent "
            f"(decode); drafting {s['speedup']:.2f}x\n"
            f"  drafting stops paying     {stop}")


def _summary_core(d: dict[str, object]) -> str:
    pool = (f" + {d['prefill_gpus']} prefill (TP{d['prefill_tp']} EP{d['prefill_ep']} "
            f"DP{d['prefill_attention_dp']})" if d["prefill_gpus"] else "")
    return (f"{d['model']} on {d['gpus']}× {d['hardware']} (TP{d['tp']} EP{d['ep']} DP{d['attention_dp']}){pool}, "
            f"concurrency {d['concurrency']}, context {d['context']:,.0f}\n"
            f"  tokens/s per agent        {d['tokens_per_s_per_agent']:,.1f}\n"
            f"  output tokens/s per GPU   {d['output_tokens_per_s_per_gpu']:,.1f}\n"
            f"  step time                 {d['step_time_ms']:.3f} ms ({d['bound']}-bound)\n"
            f"  TTFT (idle)               {d['ttft_ms']:,.1f} ms\n"
            f"  sessions that fit         {d['sessions_fit']:,}\n"
            f"  $ per million output tok  {_cost(d['cost_per_million_output_tokens'])}")


def _cost(x: float | None) -> str:
    return "not priced (--cost-per-gpu-hour prices it)" if x is None else f"{x:.4g}"


def _refuse_misfit(reasons: list[str], allow: bool) -> bool:
    """Say why a deployment does not fit; True when its numbers must not be printed."""
    if not reasons:
        return False
    lead = "does not fit" if allow else "error: this deployment does not fit"
    for reason in reasons:
        print(textwrap.fill(f"flashserve plan: {lead}: {reason}", 80, subsequent_indent="  "), file=sys.stderr)
    if not allow:
        print("flashserve plan: no speed or cost printed; change the deployment, or pass\n"
              "  --allow-misfit to see them anyway", file=sys.stderr)
    return not allow


def _run(a: argparse.Namespace) -> int:
    from .explain import explain_rows, print_explain
    from .planner import build_deployment, plan, speed_gaps

    inp = _inputs(a)
    dep = build_deployment(inp)
    gaps = speed_gaps(dep)
    if gaps:
        return _without_speed(a, inp, dep, gaps)
    res = plan(inp, model=dep.model, hw=dep.hw)
    if res.misfit() and not a.allow_misfit and dep.hw.machine is not None and not a.json:
        print(_machine_text(res.as_dict()["machine"]), end="")  # what was loaded, beside the refusal
    if _refuse_misfit(res.misfit(), a.allow_misfit):
        return 1
    if a.json:
        d = res.as_dict()
        if a.explain:
            d["terms"] = [dict(zip(("section", "term", "value", "note"), row)) for row in explain_rows(res)]
        print(json.dumps(d, indent=1))
    elif a.explain:
        print_explain(res)
    else:
        if res.misfit():  # shown under --allow-misfit: say so beside the numbers, not only on stderr
            print("DOES NOT FIT (numbers shown under --allow-misfit; reasons on stderr)")
        print(_summary(res.as_dict()))
    return 0


def _without_speed(a: argparse.Namespace, inp: PlanInputs, dep, gaps: list[str]) -> int:
    """A machine whose speed cannot be predicted: what it is, whether the model fits, and why no speed."""
    from .capacity import capacity
    from .planner import machine_summary, misfit_reasons

    ctx = inp.resolved_context()
    cap = capacity(dep, ctx)
    reasons = misfit_reasons(dep, cap, inp.concurrency, ctx)
    d = {"model": dep.model.name, "hardware": dep.hw.name, "gpus": dep.gpus, "concurrency": inp.concurrency,
         "context": ctx, "weight_dtype": dep.expert_dtype, "dense_dtype": dep.dense_dtype,
         "speed_predicted": False, "cannot_predict": gaps, "fits": not reasons, "misfit": reasons,
         "sessions_fit": cap.sessions_fit, "capacity": cap.as_dict(), "machine": machine_summary(dep)}
    if a.json:
        print(json.dumps(d, indent=1))
    else:
        print(_machine_text(d["machine"]) + f"{d['model']} on {d['gpus']}x {d['hardware']}, concurrency "
              f"{inp.concurrency}, context {ctx:,.0f}\n"
              f"  weights per device        {cap.weight_bytes_per_gpu / 1e9:,.1f} GB\n"
              f"  sessions that fit         {cap.sessions_fit:,}\n"
              f"  fits                      {'yes' if not reasons else 'NO (reasons on stderr)'}\n"
              f"  speed and cost            not predicted (reason on stderr)")
    for reason in reasons:
        print(textwrap.fill(f"flashserve plan: does not fit: {reason}", 80, subsequent_indent="  "), file=sys.stderr)
    for gap in gaps:
        print(textwrap.fill(f"flashserve plan: cannot predict speed: {gap}", 80, subsequent_indent="  "),
              file=sys.stderr)
    return 1


def _sweep(a: argparse.Namespace) -> int:
    from .planner import build_deployment, speed_gaps
    from .sweep import DEFAULT_LEVELS, sweep, sweep_points, write_sweep

    levels = _int_list(a.levels, "--levels") if a.levels else list(DEFAULT_LEVELS)
    gaps = speed_gaps(build_deployment(_inputs(a)))
    if gaps:
        raise PlanError("--hardware", f"cannot predict speed: {gaps[0]}")
    results = sweep(_inputs(a), levels)
    prefix = Path(a.out)
    if prefix.parent and not prefix.parent.exists():
        raise PlanError("--out", f"folder {prefix.parent} does not exist")
    json_path, png_path = prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".png")
    misfits = {r.inputs.concurrency: r.misfit() for r in results if r.misfit()}
    kept = results if a.allow_misfit else [r for r in results if not r.misfit()]
    for level, reasons in misfits.items():
        print(f"flashserve plan: concurrency {level}: does not fit: {'; '.join(reasons)}", file=sys.stderr)
    if not kept:
        print("flashserve plan: no concurrency level fits; nothing written (--allow-misfit to plot them)",
              file=sys.stderr)
        return 1
    write_sweep(kept, json_path, png_path)
    if a.json:
        print(json.dumps({"json": str(json_path), "png": str(png_path), "points": sweep_points(kept),
                          "misfits": [{"concurrency": c, "reasons": r} for c, r in misfits.items()]}, indent=1))
    else:
        for p in sweep_points(kept):
            print(f"concurrency {p['concurrency']:>6}: {p['tokens_per_s_per_agent']:9.1f} tok/s/agent "
                  f"{p['output_tokens_per_s_per_gpu']:10.1f} tok/s/GPU  ({p['bound']}{'' if p['fits'] else ', DOES NOT FIT'})")
        print(f"wrote {json_path} and {png_path}")
    return 0


def _calibrate(a: argparse.Namespace) -> int:
    from .calibrate import calibrate, read_bench

    terms = [t.strip() for t in a.fit.split(",") if t.strip()]
    cal = calibrate(read_bench(a.calibrate, _inputs(a)), terms)
    if a.json:
        print(json.dumps(cal.as_dict(), indent=1))
        return 0
    print("fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in cal.fitted.items()))
    for p in cal.points:
        print(f"  concurrency {p.concurrency:>6}: measured {p.measured_agent:9.2f} predicted {p.predicted_agent:9.2f} "
              f"tok/s/agent ({p.agent_error:+.1%}){'  held out' if p.held_out else ''}")
    print(f"mean |error|: fit {cal.mean_abs_error(False):.1%}, held out {cal.mean_abs_error(True):.1%}")
    for w in cal.warnings():
        print(textwrap.fill(f"warning: {w}", 80, subsequent_indent="  "))
    return 0


def _published(a: argparse.Namespace) -> int:
    from .validation import (
        compare_published,
        compare_published_local,
        compare_published_prefill,
        compare_published_speedups,
        compare_switch_off,
        local_bar,
    )

    rows, prefill, speedups = compare_published(), compare_published_prefill(), compare_published_speedups()
    switch_off = compare_switch_off()
    local = compare_published_local()
    bar = local_bar(local)
    if a.json:
        print(json.dumps({"decode": rows, "prefill": prefill, "speculation": speedups,
                          "switch_off": switch_off, "local": local, "local_bar": bar}, indent=1))
        return 0
    for r in rows:
        gpu = f" | per GPU {r['predicted_gpu']:,.0f} vs {r['published_gpu']:,.0f} ({r['gpu_error']:+.0%})" if r["published_gpu"] else ""
        print(f"{r['name']:28} [{r['role']:8}] per agent {r['predicted_agent']:7.1f} vs {r['published_agent']:6.0f} "
              f"({r['agent_error']:+.0%}){gpu}")
    for r in prefill:
        print(f"{r['name']:32} [{r['role']:8}] prefill tokens/s per GPU {r['predicted_gpu']:6,.0f} vs "
              f"{r['published_gpu']:6,.0f} ({r['gpu_error']:+.0%})")
    for r in speedups:
        print(f"{r['name']:32} [{r['role']:8}] speed-up of drafting {r['predicted_speedup']:.2f}x vs "
              f"{r['published_speedup']:.2f}x ({r['speedup_error']:+.0%})")
    for r in switch_off:
        c = f"{r['predicted_crossover']:,}" if r["predicted_crossover"] else f"none up to {r['checked_up_to']:,}"
        print(f"{r['name']:32} [{r['role']:8}] drafting stops paying from {c} vs published between "
              f"{r['pays_at']:,} and {r['loses_at']:,}")
    print("local machines (decode tokens/s over the concurrent streams):")
    for r in local:
        if r["predicted_decode"] is None:
            print(f"{r['name']:36} [{r['role']:8}] published {r['published_decode']:6.1f} at C{r['concurrency']}: "
                  f"not predicted: {r['assumptions']}")
        else:
            print(f"{r['name']:36} [{r['role']:8}] decode {r['predicted_decode']:6.1f} vs {r['published_decode']:6.1f} "
                  f"at C{r['concurrency']} ({r['error']:+.0%})")
    worst = "none" if bar["worst_held_out_error"] is None else f"{bar['worst_held_out_error']:.0%}"
    print(f"local bar ({bar['bar']}): {'met' if bar['met'] else 'not met'}; {bar['held_out']} held out "
          f"(worst error {worst}), {bar['fitted']} fitted, {bar['not_predicted']} not predicted")
    return 0


def _seed(a: argparse.Namespace) -> int:
    from .seed import SEED_PUBLISHED, SOLVED_TERM, seed_scenario

    res = seed_scenario()
    m = res["measured"]
    out: dict[str, object] = {"measured": {
        "stack": m.deployment.stack, SOLVED_TERM: getattr(m.deployment.eff, SOLVED_TERM),
        "spec_step_overhead_us": m.deployment.eff.spec_step_overhead_us,
        "predicted": m.tokens_per_s_per_agent, "step_time_ms": m.step.t_step * 1e3,
        "error_vs": {k: m.tokens_per_s_per_agent / v - 1.0 for k, v in SEED_PUBLISHED.items()}}}
    for k in SEED_PUBLISHED:
        out[k] = {"published": SEED_PUBLISHED[k], "predicted": res[k].tokens_per_s_per_agent,
                  SOLVED_TERM: getattr(res[k].deployment.eff, SOLVED_TERM), "step_time_ms": res[k].step.t_step * 1e3,
                  "cost_per_million_output_tokens": res[k].cost_per_million_output_tokens}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(_seed_text(out, SOLVED_TERM))
    return 0


def _seed_text(out: dict, term: str) -> str:
    """``plan seed`` in words: the prediction with the measured stack, then what would have to be true."""
    m = out["measured"]
    per_step = f" + {m['spec_step_overhead_us']:g} us per DSpark step" if m.get("spec_step_overhead_us") else ""
    lines = [f"measured stack {m['stack']} ({m[term]:g} us per layer{per_step}): {m['predicted']:.0f} tokens/s "
             f"per agent, step {m['step_time_ms']:.2f} ms",
             f"  vs published before 596 ({m['error_vs']['before']:+.0%}) and after 848 "
             f"({m['error_vs']['after']:+.0%}): the headline is not reproduced by the measured stack",
             "what would have to be true (per-layer time solved, all other terms the same):"]
    for k in ("before", "after"):
        lines.append(f"  {k:6}: {out[k][term]:.1f} us per layer -> {out[k]['predicted']:.0f} tokens/s per agent "
                     f"(published {out[k]['published']:.0f}), step {out[k]['step_time_ms']:.2f} ms")
    return "\n".join(lines)


def _verdict(a: argparse.Namespace) -> int:
    from .verdict import THROUGHPUT_BASE, verdict

    base = replace(THROUGHPUT_BASE, model=a.model, hardware=a.hardware) if a.model != THROUGHPUT_BASE.model or \
        a.hardware != THROUGHPUT_BASE.hardware else THROUGHPUT_BASE
    v = verdict(base)
    if a.json:
        print(json.dumps({"peak_output_tokens_per_s_per_gpu": v.peak_output_tokens_per_s,
                          "best_output_tokens_per_s_per_gpu": v.best_output_tokens_per_s,
                          "required_tokens_per_s_per_gpu_for_price": v.required_for_price,
                          "hit_rate_for_1m_tokens_per_s": v.hit_rate_for_tokens,
                          "hit_rate_for_price": v.hit_rate_for_price, "lines": v.lines()}, indent=1))
    else:
        print("\n".join(v.lines()))
    return 0


def _check_action_flags(a: argparse.Namespace) -> None:
    """Refuse flags a fixed-scenario action would otherwise silently ignore."""
    allowed = ACTION_FLAGS.get(a.action)
    if allowed is None:
        return
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    names = [k for k in defaults if k not in ("action", "given")]
    if hasattr(a, "given"):  # parsed by add_arguments' parser: every flag given, whatever its value
        given = [k for k in names if k in a.given and k not in allowed]
    else:  # a namespace built elsewhere: the flags whose value differs from the default
        given = [k for k in names if k not in allowed and getattr(a, k, None) != defaults[k]]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        keep = ", ".join("--" + k for k in sorted(allowed))
        raise PlanError(flags, f"plan {a.action} plans a fixed, documented scenario and takes only {keep}")


def run(a: argparse.Namespace) -> int:
    """Dispatch a parsed namespace; PlanError becomes one line on stderr and exit code 2."""
    try:
        _check_action_flags(a)
        a.hardware = hardware_name(a.hardware)  # GB300, gb300 -> gb300-nvl72
        if a.action in ("run", "sweep") or a.calibrate:
            _machine_first(a)
        if a.calibrate:
            return _calibrate(a)
        return {"run": _run, "sweep": _sweep, "published": _published, "seed": _seed, "verdict": _verdict}[a.action](a)
    except PlanError as exc:
        print(f"flashserve plan: error: {exc}", file=sys.stderr)
        return 2


def _machine_first(a: argparse.Namespace) -> None:
    """Check the machine flags and a machine file before any work; a machine's GPU count is the default
    for --gpus."""
    overrides = _machine_overrides(a)
    for key, value in overrides.items():
        if not value > 0 or value == float("inf"):
            raise PlanError("--" + key.replace("_", "-"), f"must be a positive number, got {value!r}")
    hw = get_hardware(a.hardware, overrides=overrides)
    if hw.machine is not None and "gpus" not in getattr(a, "given", {"gpus"}):
        a.gpus = max(hw.machine.devices - a.prefill_gpus, 1)


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to a parent parser's subparsers; its handler is ``args.func(args) -> int``."""
    p = subparsers.add_parser("plan", help="performance, capacity and cost model", description=DESCRIPTION,
                              formatter_class=HelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m flashserve.plan [action] [flags]``."""
    parser = argparse.ArgumentParser(prog="flashserve plan", description=DESCRIPTION, formatter_class=HelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
