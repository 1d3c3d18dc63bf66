"""The engine's own slice runs as planner points: ``scripts/bench_slice.py --json`` files (decode-only tokens/s of a
real-size slice at several batch sizes on this machine; the stored runs are eager, ``--enforce-eager``) planned on a machine file, calibrated on one run,
the others predicted (``scripts/plan_slices.py check``; the check in docs/plan.md section 6)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from .calibrate import Measured, _predict, _resolve, fit
from .hardware import get_hardware
from .inputs import PlanInputs

FIT_TERMS = ("eta_mem", "eta_flop")  # two batch sizes of one run pin the memory and the compute term


@dataclass(frozen=True)
class RunPoint:
    run: str
    batch: int
    fitted: bool
    measured: float  # decode tokens/s of the whole batch
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


def run_points(run: dict[str, Any], machine: str, config: str | None = None) -> list[Measured]:
    """One point per batch size of a bench_slice run: the slice's config (``config``, else ``slice/config.json``),
    experts MXFP4, dense FP8, the bf16 head the engine reads as such, the run's prompt and output lengths, decode
    only, uniform routing (a slice's router weights are random, so no expert is used more than another); a run under ``--weight-memory`` has the experts its cache held per layer resident, the rest on the disk at
    the bandwidth the run measured, at the hit rate each batch size measured."""
    base = PlanInputs(model=config or str(Path(run["slice"]) / "config.json"), hardware=machine, gpus=1,
                      weight_dtype="fp4", head_dtype="bf16", prompt_len=run["prompt_len"],
                      output_len=run["new_tokens"], routing_skew=0.0)
    budget = run.get("weight_memory") is not None
    if budget:
        base = replace(base, resident_experts=run["experts_held_per_layer"],
                       hardware_overrides={"disk_bandwidth": run["disk_read_GB_s"]})
    return [Measured(replace(base, concurrency=row["batch"],
                             expert_hit_rate=row["expert_hit_rate"] if budget else None),
                     row["tok_s"] / row["batch"], decode_only=True) for row in run["rows"]]


def check_runs(runs: Sequence[tuple[str, list[Measured]]], machine: str) -> tuple[dict[str, float], list[RunPoint]]:
    """Fit FIT_TERMS on the first run's points (the machine's profile as the start), predict every point."""
    eff = get_hardware(machine).efficiency
    fitted = fit(runs[0][1], FIT_TERMS, {t: getattr(eff, t) for t in FIT_TERMS})
    out = []
    for i, (name, points) in enumerate(runs):
        for r in _resolve(points):
            agent, _ = _predict(r, fitted)
            b = r.point.inputs.concurrency
            out.append(RunPoint(name, b, i == 0, r.point.tokens_per_s_per_agent * b, agent * b))
    return fitted, out
