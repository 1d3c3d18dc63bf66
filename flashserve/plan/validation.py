"""Predicted versus published: run the planner on every documented published point."""

from __future__ import annotations

from .planner import PlanResult, plan
from .scenarios import (
    PUBLISHED,
    PUBLISHED_LOCAL,
    PUBLISHED_PREFILL,
    PUBLISHED_SPEEDUP,
    PUBLISHED_SWITCH_OFF,
    PublishedLocal,
    PublishedPoint,
    PublishedPrefill,
    PublishedSpeedup,
    PublishedSwitchOff,
)


def predicted_per_gpu(point: PublishedPoint, res: PlanResult) -> float | None:
    """The planner output that matches the point's per-GPU metric."""
    if point.metric == "decode":
        return res.decode_tokens_per_s_per_gpu
    if point.metric == "total":
        return res.total_tokens_per_s_per_gpu
    return None


def compare_published(points: tuple[PublishedPoint, ...] = PUBLISHED) -> list[dict[str, object]]:
    """One row per point: predicted and published per-agent and per-GPU figures and relative errors."""
    rows: list[dict[str, object]] = []
    for p in points:
        res = plan(p.inputs)
        gpu = predicted_per_gpu(p, res)
        agent = res.accept_length / res.step.t_step if p.agent_metric == "step" else res.tokens_per_s_per_agent
        rows.append({
            "name": p.name, "role": p.role, "source": p.source, "assumptions": p.assumptions,
            "hardware": p.inputs.hardware, "concurrency": p.inputs.concurrency,
            "predicted_agent": agent, "published_agent": p.tokens_per_s_per_agent,
            "agent_error": agent / p.tokens_per_s_per_agent - 1.0,
            "predicted_gpu": gpu, "published_gpu": p.tokens_per_s_per_gpu,
            "gpu_error": (gpu / p.tokens_per_s_per_gpu - 1.0) if gpu and p.tokens_per_s_per_gpu else None,
            "profile": res.deployment.eff.name, "bound": res.step.bound,
        })
    return rows


def compare_published_prefill(points: tuple[PublishedPrefill, ...] = PUBLISHED_PREFILL) -> list[dict[str, object]]:
    """One row per prefill point: predicted and published uncached prompt tokens/s per GPU and the error."""
    rows: list[dict[str, object]] = []
    for p in points:
        pre = plan(p.inputs).prefill
        rows.append({
            "name": p.name, "role": p.role, "source": p.source, "assumptions": p.assumptions,
            "hardware": p.inputs.hardware, "prompt_len": p.inputs.prompt_len,
            "prefix_hit_rate": p.inputs.prefix_hit_rate,
            "predicted_gpu": pre.tokens_per_s_per_gpu, "published_gpu": p.uncached_tokens_per_s_per_gpu,
            "gpu_error": pre.tokens_per_s_per_gpu / p.uncached_tokens_per_s_per_gpu - 1.0, "bound": pre.bound,
        })
    return rows


def compare_published_speedups(points: tuple[PublishedSpeedup, ...] = PUBLISHED_SPEEDUP) -> list[dict[str, object]]:
    """One row per with/without pair: predicted and published speed-up of speculation and the error."""
    rows: list[dict[str, object]] = []
    for p in points:
        res = plan(p.inputs)
        spec = res.speculation
        rows.append({
            "name": p.name, "role": p.role, "source": p.source, "assumptions": p.assumptions,
            "hardware": p.inputs.hardware, "concurrency": p.inputs.concurrency,
            "predicted_speedup": spec.speedup, "published_speedup": p.speedup,
            "speedup_error": spec.speedup / p.speedup - 1.0,
            "predicted_crossover": spec.crossover_concurrency,
        })
    return rows


def compare_switch_off(points: tuple[PublishedSwitchOff, ...] = PUBLISHED_SWITCH_OFF) -> list[dict[str, object]]:
    """One row per published with/without sweep: the planner's crossover against the bracket it implies."""
    rows: list[dict[str, object]] = []
    for p in points:
        spec = plan(p.inputs).speculation
        c = spec.crossover_concurrency
        rows.append({
            "name": p.name, "role": p.role, "source": p.source, "assumptions": p.assumptions,
            "predicted_crossover": c, "checked_up_to": spec.checked_up_to,
            "pays_at": p.pays_at, "loses_at": p.loses_at,
            "within": c is not None and p.pays_at < c <= p.loses_at,
            "ratio_to_bracket": (c / p.loses_at if c and c > p.loses_at else (c / p.pays_at if c else None)),
        })
    return rows


LOCAL_BAR = 0.30  # the local bar: every held-out local point within 30%, at least four of them held out
LOCAL_MIN_HELD_OUT = 4


def compare_published_local(points: tuple[PublishedLocal, ...] = PUBLISHED_LOCAL) -> list[dict[str, object]]:
    """One row per local point: predicted and published decode tokens/s over the point's concurrent streams
    (concurrency x accept length / decode step; prefill excluded, as the reports time decode apart from TTFT)
    and the error; a point the planner cannot express has no prediction and says why."""
    rows: list[dict[str, object]] = []
    for p in points:
        row: dict[str, object] = {"name": p.name, "role": p.role, "source": p.source, "setup": p.setup,
                                  "assumptions": p.assumptions, "concurrency": p.concurrency,
                                  "published_decode": p.decode, "predicted_decode": None, "error": None,
                                  "hardware": None, "profile": None, "bound": None,
                                  "weight_dtype": p.weight_dtype, "weight_dtype_basis": p.weight_dtype_basis}
        if p.inputs is not None:
            res = plan(p.inputs)
            pred = p.concurrency * res.accept_length / res.step.t_step
            row.update(predicted_decode=pred, error=pred / p.decode - 1.0, hardware=p.inputs.hardware,
                       profile=res.deployment.eff.name, bound=res.step.bound)
        rows.append(row)
    return rows


def local_bar(rows: list[dict[str, object]]) -> dict[str, object]:
    """Issue 53's bar on the local points: held-out count, worst held-out error, and whether it is met."""
    held = [r for r in rows if r["role"] == "held_out"]
    worst = max((abs(float(r["error"])) for r in held), default=None)  # type: ignore[arg-type]
    met = len(held) >= LOCAL_MIN_HELD_OUT and worst is not None and worst <= LOCAL_BAR
    return {"held_out": len(held), "fitted": sum(r["role"] == "fit" for r in rows),
            "not_predicted": sum(r["role"] == "not_predicted" for r in rows), "worst_held_out_error": worst,
            "bar": f"every held-out point within {LOCAL_BAR:.0%}, at least {LOCAL_MIN_HELD_OUT} held out", "met": met}
