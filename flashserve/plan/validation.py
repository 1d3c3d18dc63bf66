"""Predicted versus published: run the planner on every documented published point."""

from __future__ import annotations

from .planner import PlanResult, plan
from .scenarios import (PUBLISHED, PUBLISHED_PREFILL, PUBLISHED_SPEEDUP, PUBLISHED_SWITCH_OFF, PublishedPoint,
                        PublishedPrefill, PublishedSpeedup, PublishedSwitchOff)


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
