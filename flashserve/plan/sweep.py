"""Sweep concurrency: per-agent tokens/s against output tokens/s per GPU, as JSON and a PNG chart.

The axes match ``flashserve bench sweep`` (x: tokens/s per agent, y: output tokens/s per GPU) so a measured
curve and a predicted one overlay.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from .hardware import get_hardware
from .inputs import PlanInputs
from .models import resolve_model
from .planner import PlanResult, plan

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def sweep(base: PlanInputs, levels: Sequence[int] = DEFAULT_LEVELS) -> list[PlanResult]:
    """Plan ``base`` at each concurrency in ``levels`` (the model and hardware are looked up once)."""
    model = resolve_model(base.model, base.kv_dtype)
    hw = get_hardware(base.hardware, overrides=base.hardware_overrides)
    return [plan(replace(base, concurrency=c), model=model, hw=hw) for c in levels]


def sweep_points(results: Sequence[PlanResult]) -> list[dict[str, float | int | bool]]:
    """The curve in ``bench sweep``'s point format, plus the planner's bound and fit flag, and on a machine each
    tier's bytes per token and time (``tiers``) and the bottleneck."""
    points: list[dict[str, float | int | bool]] = []
    for r in results:
        point: dict[str, float | int | bool] = {
            "concurrency": r.inputs.concurrency,
            "tokens_per_s_per_agent": r.tokens_per_s_per_agent,
            "output_tokens_per_s_per_gpu": r.output_tokens_per_s_per_gpu,
            "step_time_ms": r.step.t_step * 1e3,
            "bound": r.step.bound,
            "fits": not r.misfit(),
        }
        without = r.tokens_per_s_per_agent_without_speculation
        if without is not None:  # the second curve: the same deployment with the drafter off
            point["tokens_per_s_per_agent_without_speculation"] = without
            point["output_tokens_per_s_per_gpu_without_speculation"] = (
                r.output_tokens_per_s_per_gpu * without / r.tokens_per_s_per_agent)
            point["speculation_speedup"] = r.speculation.speedup
        if r.deployment.hw.machine is not None:  # a machine: each tier's bytes and time at this concurrency
            from .planner import tier_summary

            t = tier_summary(r)
            point["tiers"] = [{k: row[k] for k in ("tier", "bytes_per_token", "time_ms")} for row in t["tiers"]]
            point["bottleneck"] = t["bottleneck"]
        points.append(point)
    return points


def write_sweep(results: Sequence[PlanResult], json_path: Path, png_path: Path) -> None:
    """Write the curve as JSON and as a PNG (matplotlib, Agg backend)."""
    points = sweep_points(results)
    first = results[0].as_dict()
    meta = {k: first[k] for k in ("model", "hardware", "gpus", "tp", "ep", "attention_dp", "weight_dtype",
                                  "kv_dtype", "context", "accept_length", "efficiency_profile")}
    spec = results[0].speculation
    if spec is not None:  # where drafting stops paying (the same for every level of this deployment)
        meta["speculation_crossover_concurrency"] = spec.crossover_concurrency
    json_path.write_text(json.dumps({"source": "flashserve plan sweep", **meta, "points": points}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = [p for p in points if p["fits"]]
    over = [p for p in points if not p["fits"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([p["tokens_per_s_per_agent"] for p in points], [p["output_tokens_per_s_per_gpu"] for p in points],
            "-", color="tab:blue", alpha=0.5)
    ax.plot([p["tokens_per_s_per_agent"] for p in fits], [p["output_tokens_per_s_per_gpu"] for p in fits],
            "o", color="tab:blue", label="predicted (fits in HBM)")
    if over:
        ax.plot([p["tokens_per_s_per_agent"] for p in over], [p["output_tokens_per_s_per_gpu"] for p in over],
                "x", color="tab:red", label="predicted (exceeds HBM)")
    plain = [p for p in points if "tokens_per_s_per_agent_without_speculation" in p]
    if plain:
        ax.plot([p["tokens_per_s_per_agent_without_speculation"] for p in plain],
                [p["output_tokens_per_s_per_gpu_without_speculation"] for p in plain], "s--", color="tab:gray",
                markersize=3, label="predicted without drafting")
    for p in points:
        ax.annotate(str(p["concurrency"]), (p["tokens_per_s_per_agent"], p["output_tokens_per_s_per_gpu"]),
                    fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("tokens/s per agent")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"{meta['model']} on {meta['gpus']}× {meta['hardware']} (context {meta['context']:.0f})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
