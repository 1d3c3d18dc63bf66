"""Serving metrics of one benchmark run, defined as ``vllm bench serve`` defines them.

Per successful request: TTFT (first streamed token after the request was sent), E2E latency (last streamed
token), TPOT = (E2E − TTFT) / (output tokens − 1) for requests with more than one output token, and ITLs
(the gaps between consecutive streamed chunks; a chunk carrying several tokens is one gap). Summaries are
the mean, median, standard deviation and chosen percentiles over requests (ITL: over all gaps), in ms.
Goodput counts the requests meeting every given SLO (a request with one output token has TPOT 0 there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ..errors import UserError

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What one request measured (seconds, from the moment it was sent)."""

    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""


def chunk_times_to_result(prompt_len: int, times: Sequence[float], output_tokens: int) -> RequestResult:
    """A successful result from the times (since sending) at which chunks with new tokens arrived."""
    if not times:
        return RequestResult(prompt_len, error="the stream ended without a token")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return RequestResult(prompt_len, success=True, ttft=times[0], itl=gaps, latency=times[-1],
                         output_tokens=output_tokens)


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise UserError(f"--goodput: expected NAME:MS with NAME one of ttft, tpot, e2el; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise UserError(f"--goodput: {name} needs a number of milliseconds, got {value!r}") from None
        if not ms > 0 or math.isinf(ms):
            raise UserError(f"--goodput: {name} must be a positive number of milliseconds, got {value!r}")
        slos[name] = ms
    return slos


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 → ``p99``, 99.9 → ``p99.9``."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _summary(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    data = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1e3
    out = {f"mean_{name}_ms": float(np.mean(data)), f"median_{name}_ms": float(np.median(data)),
           f"std_{name}_ms": float(np.std(data))}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(data, p))
    return out


def _good_requests(done: Sequence[RequestResult], tpots: Sequence[float], slos: dict[str, float]) -> int:
    per_metric = {"ttft": [r.ttft for r in done], "tpot": tpots, "e2el": [r.latency for r in done]}
    good = 0
    for i in range(len(done)):
        if all(per_metric[name][i] * 1e3 <= ms for name, ms in slos.items()):
            good += 1
    return good


def compute_metrics(results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float] = (99,),
                    goodput: dict[str, float] | None = None) -> dict[str, object]:
    """The run's summary under vLLM's field names (``completed``, ``median_ttft_ms``, ``output_throughput``...)."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    done = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    all_tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0 for r in done]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    out: dict[str, object] = {
        "duration": duration_s, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "request_goodput": _good_requests(done, all_tpots, goodput) / duration_s if goodput else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    out.update(_summary("ttft", [r.ttft for r in done], percentiles))
    out.update(_summary("tpot", tpots, percentiles))
    out.update(_summary("itl", [g for r in done for g in r.itl], percentiles))
    out.update(_summary("e2el", [r.latency for r in done], percentiles))
    return out


def agent_and_cost(metrics: dict[str, object], devices: int, cost_per_hour: float | None) -> dict[str, object]:
    """Per-agent decode speed (1000 / median TPOT), output tokens/s per device and $ per million output
    tokens ($/device-hour × devices × 10⁶ / (3600 × output tokens/s), the planner's formula)."""
    from ..plan.planner import cost_per_million

    tpot = float(metrics["median_tpot_ms"])  # type: ignore[arg-type]
    throughput = float(metrics["output_throughput"])  # type: ignore[arg-type]
    cost = None
    if cost_per_hour is not None and throughput > 0:
        cost = cost_per_million(cost_per_hour, devices, throughput)
    return {"tokens_per_s_per_agent": 1000.0 / tpot if tpot > 0 else None,
            "num_devices": devices, "output_tokens_per_s_per_device": throughput / devices,
            "device_cost_per_hour": cost_per_hour, "cost_per_million_output_tokens": cost}
