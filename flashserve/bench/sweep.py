"""``flashserve bench sweep``: ``bench serve`` at rising concurrency, one JSON per point, ``sweep.json`` with
every configuration measured into the folder, and ``sweep.png``: tokens/s per agent (x) against output
tokens/s per device (y), a curve per configuration, cost per million output tokens on the points, and the
planner's predicted curve for the same setup beside the measured one.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from ..errors import UserError
from .serve import ServeConfig, load_bench_tokenizer, local_model, make_backend, run_async, with_tokenizer

SWEEP_JSON, SWEEP_PNG = "sweep.json", "sweep.png"
# why a server's sweep has no planner curve unless asked: the planner needs the hardware, which a URL does not say
NO_PLAN_NOTE = ("no planner curve: the server's hardware is not known (pass --plan-hardware, e.g. h100 or "
                "cpu-local, to draw one)")


@dataclass(frozen=True)
class PlanSetup:
    """The planner deployment drawn beside a measured curve. ``accept_length`` None: the acceptance length
    the server reported over the sweep, or 1 (no speculation) when it reported none."""

    hardware: str
    model: str | None = None
    weight_dtype: str = "fp32"
    gpus: int | None = None
    tp: int = 1
    ep: int | None = None
    stack: str | None = None  # None: the planner's default for the model and hardware; "none": off
    accept_length: float | None = None
    draft_tokens: int | None = None


@dataclass
class SweepOutput:
    points: list[Path] = field(default_factory=list)
    summary: Path | None = None
    chart: Path | None = None
    lines: list[str] = field(default_factory=list)
    failed_levels: list[int] = field(default_factory=list)  # levels where no request completed


def levels_from(text: str | None, maximum: int | None) -> list[int]:
    """Concurrency levels: the comma-separated list, or 1, 2, 4, ... up to ``maximum`` (included)."""
    if text:
        try:
            levels = sorted({int(x) for x in text.split(",") if x.strip()})
        except ValueError:
            raise UserError(f"--concurrency: expected comma-separated integers, got {text!r}") from None
    elif maximum:
        levels = [1 << i for i in range(maximum.bit_length()) if 1 << i < maximum] + [maximum]
    else:
        raise UserError("bench sweep needs --concurrency 1,2,4 or --max-concurrency N")
    if not levels or levels[0] < 1:
        raise UserError("bench sweep: every concurrency level must be >= 1")
    return levels


def _point(result: dict[str, Any], level: int) -> dict[str, Any]:
    """One measured point in the planner's calibration format."""
    return {"concurrency": level, "tokens_per_s_per_agent": result["tokens_per_s_per_agent"],
            "output_tokens_per_s_per_gpu": result["output_tokens_per_s_per_device"],
            "cost_per_million_output_tokens": result["cost_per_million_output_tokens"],
            "median_tpot_ms": result["median_tpot_ms"], "median_ttft_ms": result["median_ttft_ms"]}


def measured_accept_length(results: Sequence[dict[str, Any]]) -> float | None:
    """Acceptance length over every level (1 + accepted / drafts, summed), or None without spec counters."""
    drafts = sum(r.get("spec_decode_num_drafts", 0) for r in results)
    accepted = sum(r.get("spec_decode_accepted_tokens", 0) for r in results)
    return 1.0 + accepted / drafts if drafts else None


def _plan_inputs(plan: PlanSetup, cfg: ServeConfig, prompt_len: int, output_len: int,
                 measured_al: float | None) -> tuple[Any, str]:
    """The planner's inputs for the measured setup, and where its acceptance length came from."""
    from ..plan.inputs import PlanInputs

    if plan.accept_length is not None:
        al, src = plan.accept_length, "--plan-accept-length"
    elif measured_al is not None:
        al, src = measured_al, "measured by the server"
    else:
        al, src = 1.0, "no speculation reported"
    served = cfg.served_model and (local_model(cfg.served_model) or cfg.served_model)  # flashserve-default: its folder
    model = plan.model or cfg.model or cfg.model_root or served or ""
    inp = PlanInputs(model=model, hardware=plan.hardware, gpus=plan.gpus or cfg.num_devices, tp=plan.tp,
                     ep=plan.ep, weight_dtype=plan.weight_dtype, prompt_len=max(prompt_len, 1),
                     output_len=max(output_len, 1), accept_length=al, draft_tokens=plan.draft_tokens,
                     stack=plan.stack)
    return inp, f"acceptance length {al:.3g} ({src})"


def predicted_curve(plan: PlanSetup, cfg: ServeConfig, levels: Sequence[int], prompt_len: int, output_len: int,
                    measured_al: float | None = None) -> dict[str, Any]:
    """The planner's points at ``levels`` for the measured workload (levels that do not fit left out and
    named), with a note saying which setup was planned; ``predicted`` None and the reason when it cannot."""
    from ..plan.errors import PlanError
    from ..plan.sweep import sweep, sweep_points

    inp, al_note = _plan_inputs(plan, cfg, prompt_len, output_len, measured_al)
    if not inp.model:
        return {"predicted": None, "predicted_misfits": [], "predicted_note": "planner curve left out: no model "
                "to plan; pass --plan-model (a preset or a checkpoint folder)"}
    try:
        results = sweep(inp, levels)
    except PlanError as exc:
        return {"predicted": None, "predicted_note": f"planner curve left out: {exc}", "predicted_misfits": []}
    dep = results[0].deployment
    misfits = [{"concurrency": r.inputs.concurrency, "reasons": r.misfit()} for r in results if r.misfit()]
    kept = sweep_points([r for r in results if not r.misfit()])
    note = (f"planner: {inp.model} on {dep.gpus}x {dep.hw.name} TP{dep.tp} EP{dep.ep}, "
            f"stack {dep.stack or 'none'}, {al_note}")
    if misfits:
        note += "; left out (does not fit): " + ", ".join(f"c={m['concurrency']}" for m in misfits)
    return {"predicted": kept or None, "predicted_note": note, "predicted_misfits": misfits}


async def _measure(cfg: ServeConfig, levels: Sequence[int]) -> list[dict[str, Any]]:
    """Run every level on one backend (an in-process engine is loaded once)."""
    tok = load_bench_tokenizer(cfg.tokenizer or "")
    backend = make_backend(cfg, tok)
    await backend.start()
    try:
        return [await run_async(replace(cfg, max_concurrency=c, num_prompts=max(cfg.num_prompts, c)), backend, tok)
                for c in levels]
    finally:
        await backend.close()


def _merge_summary(path: Path, label: str, entry: dict[str, Any]) -> dict[str, Any]:
    """``sweep.json`` with this configuration added or replaced (other labels kept)."""
    data: dict[str, Any] = {"source": "flashserve bench sweep", "configurations": {}}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"--out: {path} exists but is not JSON ({exc}); remove it or choose another folder")
    data.setdefault("configurations", {})[label] = entry
    path.write_text(json.dumps(data, indent=1))
    return data


def sweep_entry(cfg: ServeConfig, plan: PlanSetup | None, levels: Sequence[int],
                results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """This configuration's ``sweep.json`` entry: measured points, mean prompt/output lengths and the planner's
    curve for that workload, all from the levels that completed a request (the others in ``failed_levels``)."""
    done = [(c, r) for c, r in zip(levels, results) if r["completed"]]
    entry: dict[str, Any] = {"measured": [_point(r, c) for c, r in done], "predicted": None,
                             "failed_levels": [c for c, r in zip(levels, results) if not r["completed"]],
                             "predicted_note": NO_PLAN_NOTE, "predicted_misfits": [], "input_len": None,
                             "output_len": None, "num_devices": cfg.num_devices,
                             "device_cost_per_hour": cfg.device_cost_per_hour}
    if not done:
        if plan:
            entry["predicted_note"] = "planner curve left out: no level completed a request"
        return entry
    entry["input_len"] = round(sum(r["input_len_stats"]["mean"] for _, r in done) / len(done))
    entry["output_len"] = round(sum(r["output_len_stats"]["mean"] for _, r in done) / len(done))
    if plan:
        entry.update(predicted_curve(plan, cfg, levels, entry["input_len"], entry["output_len"],
                                     measured_accept_length([r for _, r in done])))
    return entry


def run_sweep(cfg: ServeConfig, levels: Sequence[int], out: Path, label: str | None,
              plan: PlanSetup | None) -> SweepOutput:
    """Measure, write the point JSONs and the summary, and draw the chart of every configuration in ``out``."""
    cfg = with_tokenizer(cfg)
    out.mkdir(parents=True, exist_ok=True)
    label = label or cfg.model or cfg.served_model or cfg.base_url or "server"
    if plan is None and cfg.model is not None:
        plan = PlanSetup("cpu-local")
    results = asyncio.run(_measure(cfg, levels))
    res = SweepOutput()
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
    for level, result in zip(levels, results):
        path = out / f"{safe}-c{level}.json"
        path.write_text(json.dumps({"label": label, **result}, indent=1))
        res.points.append(path)
        res.lines.append(f"concurrency {level:>4}: {result['tokens_per_s_per_agent'] or 0:8.2f} tok/s/agent "
                         f"{result['output_tokens_per_s_per_device']:9.2f} output tok/s/device  ({path.name})")
    entry = sweep_entry(cfg, plan, levels, results)
    res.failed_levels = entry["failed_levels"]
    note = entry["predicted_note"]
    if res.failed_levels:
        res.lines.append("no request completed at concurrency " + ", ".join(map(str, res.failed_levels))
                         + ": left out of the curve and of the workload averages (see the point JSONs' errors)")
    res.summary = out / SWEEP_JSON
    data = _merge_summary(res.summary, label, entry)
    from .chart import draw

    res.chart = draw(data, out / SWEEP_PNG)
    if note:
        res.lines.append(note)
    res.lines.append(f"wrote {len(res.points)} point JSONs, {res.summary} and {res.chart}")
    return res
