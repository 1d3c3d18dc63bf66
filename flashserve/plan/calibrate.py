"""Fit a hardware entry's efficiency terms to measured points and report the error on held-out points.

The objective is the summed squared log error of per-agent tokens/s (and of per-GPU output tokens/s where
measured). Each fitted term is searched in its own bounded range, one term at a time (golden-section
search), for a few rounds: the model has few terms and is monotone in each, so this is enough.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import PlanError
from .hardware import Hardware, get_hardware
from .inputs import PlanInputs
from .model_terms import ModelTerms
from .models import resolve_model
from .planner import plan

# Search range of every term that may be fitted (log-spaced search where the range spans decades).
BOUNDS: dict[str, tuple[float, float, bool]] = {
    "eta_mem": (0.05, 1.0, True),
    "eta_flop": (0.02, 1.0, True),
    "eta_flop_prefill": (0.02, 1.0, True),
    "eta_comm": (0.05, 1.0, True),
    "layer_overhead_us": (0.0, 50000.0, False),  # a Python engine on a CPU spends ~5 ms per layer per step
    "pass_overhead_us": (0.0, 1e5, False),
    "spec_step_overhead_us": (0.0, 1e5, False),
    "comm_overlap": (0.0, 1.0, False),
}
DEFAULT_FIT = ("eta_mem", "eta_flop", "layer_overhead_us")


@dataclass(frozen=True)
class Measured:
    """One measured point: a deployment and what was observed on it."""

    inputs: PlanInputs
    tokens_per_s_per_agent: float
    output_tokens_per_s_per_gpu: float | None = None
    decode_only: bool = False  # measured while decoding only: compare with the decode step, no prefill share


@dataclass(frozen=True)
class PointError:
    concurrency: int
    measured_agent: float
    predicted_agent: float
    measured_gpu: float | None
    predicted_gpu: float
    held_out: bool

    @property
    def agent_error(self) -> float:
        return self.predicted_agent / self.measured_agent - 1.0


@dataclass(frozen=True)
class Calibration:
    """Fitted terms and per-point errors."""

    fitted: dict[str, float]
    points: tuple[PointError, ...]

    @property
    def at_bounds(self) -> list[str]:
        """Fitted terms that ended at an end of their search range: the points did not pin them."""
        out = []
        for t, v in self.fitted.items():
            lo, hi, log = BOUNDS[t]
            u = (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo)) if log else (v - lo) / (hi - lo)
            if u < 1e-3 or u > 1 - 1e-3:
                out.append(t)
        return out

    def warnings(self) -> list[str]:
        """What makes the fit weak, in words: fewer fitted points than terms, terms stuck at a bound."""
        n = sum(not p.held_out for p in self.points)
        out = []
        if n < len(self.fitted):
            out.append(f"{len(self.fitted)} terms fitted on {n} point{'s' * (n != 1)}: more terms than points, so "
                       f"many values fit equally well; measure more concurrency levels or fit fewer terms (--fit)")
        for t in self.at_bounds:
            lo, hi, _ = BOUNDS[t]
            out.append(f"{t} ended at the end of its search range ({lo:g} to {hi:g}): the points do not pin it")
        return out

    def mean_abs_error(self, held_out: bool) -> float:
        errs = [abs(p.agent_error) for p in self.points if p.held_out == held_out]
        return sum(errs) / len(errs) if errs else float("nan")

    def as_dict(self) -> dict[str, object]:
        return {
            "fitted": self.fitted,
            "warnings": self.warnings(),
            "fit_mean_abs_error": self.mean_abs_error(False),
            "held_out_mean_abs_error": self.mean_abs_error(True),
            "points": [{**p.__dict__, "agent_error": p.agent_error} for p in self.points],
        }


@dataclass(frozen=True)
class _Resolved:
    point: Measured
    model: ModelTerms
    hw: Hardware


def _resolve(points: Sequence[Measured]) -> list[_Resolved]:
    """Look each model and hardware entry up once, not once per trial."""
    models: dict[tuple[str, str | None], ModelTerms] = {}
    hws: dict[tuple[str, tuple[tuple[str, float], ...]], Hardware] = {}
    out = []
    for p in points:
        key = (p.inputs.model, p.inputs.kv_dtype)
        if key not in models:
            models[key] = resolve_model(*key)
        hw_key = (p.inputs.hardware, tuple(sorted(p.inputs.hardware_overrides.items())))
        if hw_key not in hws:
            hws[hw_key] = get_hardware(p.inputs.hardware, overrides=p.inputs.hardware_overrides)
        out.append(_Resolved(p, models[key], hws[hw_key]))
    return out


def _predict(r: _Resolved, overrides: dict[str, float]) -> tuple[float, float]:
    inp = replace(r.point.inputs, overrides={**r.point.inputs.overrides, **overrides})
    res = plan(inp, model=r.model, hw=r.hw)
    if r.point.decode_only:
        return res.accept_length / res.step.t_step, res.decode_tokens_per_s_per_gpu
    return res.tokens_per_s_per_agent, res.output_tokens_per_s_per_gpu


def _loss(points: Sequence[_Resolved], overrides: dict[str, float]) -> float:
    total = 0.0
    for r in points:
        p = r.point
        agent, gpu = _predict(r, overrides)
        total += math.log(agent / p.tokens_per_s_per_agent) ** 2
        if p.output_tokens_per_s_per_gpu:
            total += math.log(gpu / p.output_tokens_per_s_per_gpu) ** 2
    return total


def _golden(f: Callable[[float], float], lo: float, hi: float, iters: int = 40) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def _to_unit(term: str, value: float) -> float:
    lo, hi, log = BOUNDS[term]
    return math.log(min(max(value, lo), hi)) if log else math.log1p(min(max(value, lo), hi))


def _from_unit(term: str, x: float) -> float:
    lo, hi, log = BOUNDS[term]
    return min(max(math.exp(x) if log else math.expm1(x), lo), hi)


def _nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float = 0.3, iters: int = 400) -> list[float]:
    """Minimise ``f`` from ``x0`` (plain Nelder-Mead: reflect, expand, contract, shrink)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < 1e-14:
            break
        centre = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        refl = [c + (c - w) for c, w in zip(centre, worst)]
        fr = f(refl)
        if fr < values[0]:
            exp = [c + 2 * (c - w) for c, w in zip(centre, worst)]
            fe = f(exp)
            simplex[-1], values[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(centre, worst)]
            fc = f(con)
            if fc < values[-1]:
                simplex[-1], values[-1] = con, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, xs)] for xs in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def _quantile_start(terms: Sequence[str], q: float) -> dict[str, float]:
    """Every term at fraction ``q`` of its search range (in its search space)."""
    out = {}
    for t in terms:
        lo, hi, log = BOUNDS[t]
        out[t] = math.exp(math.log(lo) + q * (math.log(hi) - math.log(lo))) if log else lo + q * (hi - lo)
    return out


def _fit_from(resolved: Sequence[_Resolved], terms: Sequence[str], start: dict[str, float],
              rounds: int) -> dict[str, float]:
    """Coordinate-wise golden-section search from ``start``, then a Nelder-Mead polish in search space."""
    values = dict(start)
    for _ in range(rounds):
        for t in terms:
            lo, hi, log = BOUNDS[t]

            def f(x: float, t: str = t, log: bool = log) -> float:
                return _loss(resolved, {**values, t: math.exp(x) if log else x})

            x = _golden(f, math.log(lo), math.log(hi)) if log else _golden(f, lo, hi)
            values[t] = math.exp(x) if log else x
    if len(terms) > 1:
        def g(xs: list[float]) -> float:
            return _loss(resolved, {**values, **{t: _from_unit(t, x) for t, x in zip(terms, xs)}})

        best = _nelder_mead(g, [_to_unit(t, values[t]) for t in terms])
        values.update({t: _from_unit(t, x) for t, x in zip(terms, best)})
    return values


def fit(points: Sequence[Measured], terms: Sequence[str], start: dict[str, float], rounds: int = 4) -> dict[str, float]:
    """Terms minimising the log error over ``points``. The search starts from ``start`` and, with several
    terms, also from each term at a quarter, half and three quarters of its range (the terms trade off
    against each other, so one start can stop in a local minimum); the lowest loss wins."""
    resolved = _resolve(points)
    for t in terms:
        if t not in BOUNDS:
            raise PlanError("--fit", f"cannot fit {t!r}; choose from {', '.join(BOUNDS)}")
    starts = [dict(start)]
    if len(terms) > 1:
        starts += [{**start, **_quantile_start(terms, q)} for q in (0.25, 0.5, 0.75)]
    fits = [_fit_from(resolved, terms, s, rounds) for s in starts]
    return min(fits, key=lambda v: _loss(resolved, v))


def _fit_term(points: Sequence[Any], term: str, error: Callable[[Any, dict[str, float]], float]) -> float:
    """The value of ``term`` minimising the summed squared ``error(point, overrides)`` (golden-section search,
    in log space where the term's range spans decades)."""
    lo, hi, log = BOUNDS[term]

    def loss(x: float) -> float:
        value = math.exp(x) if log else x
        return sum(error(p, {term: value}) ** 2 for p in points)

    x = _golden(loss, math.log(lo), math.log(hi), iters=60) if log else _golden(loss, lo, hi, iters=60)
    return math.exp(x) if log else x


def _with(inputs: PlanInputs, overrides: dict[str, float]) -> PlanInputs:
    return replace(inputs, overrides={**inputs.overrides, **overrides})


def fit_prefill_efficiency(points: Sequence[Any]) -> float:
    """``eta_flop_prefill`` fitting prefill tokens/s per GPU of
    :class:`~flashserve.plan.scenarios.PublishedPrefill` points."""
    return _fit_term(points, "eta_flop_prefill", lambda p, o: math.log(
        plan(_with(p.inputs, o)).prefill.tokens_per_s_per_gpu / p.uncached_tokens_per_s_per_gpu))


def fit_decode_term(points: Sequence[Any], term: str) -> float:
    """``term`` fitting the decode speed per agent (acceptance length / step time, what TPOT measures) of
    :class:`~flashserve.plan.scenarios.PublishedPoint` points."""
    def error(p: Any, o: dict[str, float]) -> float:
        res = plan(_with(p.inputs, o))
        return math.log(res.accept_length / res.step.t_step / p.tokens_per_s_per_agent)

    return _fit_term(points, term, error)


def fit_speculative_step(absolute: Any, speedup: Any) -> dict[str, float]:
    """``layer_overhead_us`` and ``spec_step_overhead_us`` from two published points: ``absolute`` (a
    :class:`~flashserve.plan.scenarios.PublishedPoint` with a speculative decode speed per agent) and
    ``speedup`` (a :class:`~flashserve.plan.scenarios.PublishedSpeedup`: speed with the drafter over speed
    without it). Both step times are linear in the two terms (they only add fixed time), so three plans per
    point give the coefficients and a 2×2 solve gives the values."""
    def steps(inputs: PlanInputs, o: float, f: float) -> tuple[float, float]:
        res = plan(_with(inputs, {"layer_overhead_us": o, "spec_step_overhead_us": f}))
        return res.step.t_step, res.speculation.step_without_s

    def linear(inputs: PlanInputs) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        (s0, n0), (s1, n1), (s2, n2) = steps(inputs, 0, 0), steps(inputs, 1, 0), steps(inputs, 0, 1)
        return (s0, s1 - s0, s2 - s0), (n0, n1 - n0, n2 - n0)  # (value at 0, per µs of o, per µs of F)

    (sa, _) = linear(absolute.inputs)
    target = absolute.inputs.accept_length / absolute.tokens_per_s_per_agent  # step time published
    (ss, sn) = linear(speedup.inputs)
    k = speedup.inputs.accept_length / speedup.speedup  # published step_with / step_without
    # rows: sa0 + sa1·o + sa2·F = target ; (ss0 − k·sn0) + (ss1 − k·sn1)·o + (ss2 − k·sn2)·F = 0
    a11, a12, b1 = sa[1], sa[2], target - sa[0]
    a21, a22, b2 = ss[1] - k * sn[1], ss[2] - k * sn[2], k * sn[0] - ss[0]
    det = a11 * a22 - a12 * a21
    if abs(det) < 1e-18:
        raise PlanError("fit", "the two points do not separate the per-layer and per-step terms")
    return {"layer_overhead_us": (b1 * a22 - a12 * b2) / det, "spec_step_overhead_us": (a11 * b2 - a21 * b1) / det}


def split_held_out(n: int) -> list[bool]:
    """Which of ``n`` points (sorted by concurrency) are held out: every second one from the second, or the
    last one when there are fewer than four; none when there is one."""
    if n < 2:
        return [False] * n
    if n < 4:
        return [False] * (n - 1) + [True]
    return [i % 2 == 1 for i in range(n)]


def calibrate(points: Sequence[Measured], terms: Sequence[str] = DEFAULT_FIT) -> Calibration:
    """Fit ``terms`` on the non-held-out points and report errors on all of them."""
    ordered = sorted(points, key=lambda p: p.inputs.concurrency)
    held = split_held_out(len(ordered))
    train = [p for p, h in zip(ordered, held) if not h]
    if not train:
        raise PlanError("BENCH.json", "needs at least one measured point")
    first = ordered[0].inputs
    hw = get_hardware(first.hardware, overrides=first.hardware_overrides)
    eff = hw.efficiency.with_overrides(**first.overrides)
    start = {t: getattr(eff, t) for t in terms}
    fitted = fit(train, terms, start)
    rows = []
    for r, h in zip(_resolve(ordered), held):
        p = r.point
        agent, gpu = _predict(r, fitted)
        rows.append(PointError(p.inputs.concurrency, p.tokens_per_s_per_agent, agent,
                               p.output_tokens_per_s_per_gpu, gpu, h))
    return Calibration(fitted=fitted, points=tuple(rows))


def _sweep_folder(folder: Path) -> tuple[list[object], dict[str, object]]:
    """Points and workload of the one configuration in a ``bench sweep`` folder's ``sweep.json``."""
    summary = folder / "sweep.json"
    try:
        configs = json.loads(summary.read_text()).get("configurations")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise PlanError("--calibrate", f"{folder} is not a bench sweep folder ({summary}: {exc})") from None
    if not isinstance(configs, dict) or len(configs) != 1:
        names = ", ".join(sorted(configs)) if isinstance(configs, dict) else "none"
        raise PlanError("--calibrate", f"{summary} must hold exactly one configuration (found: {names}); "
                                       "sweep each configuration into its own --out folder to calibrate on it")
    entry = next(iter(configs.values()))
    return entry.get("measured") or [], entry


def read_bench(path: str | Path, base: PlanInputs) -> list[Measured]:
    """Measured points from a ``bench sweep`` folder (its ``sweep.json``: the workload's prompt and output
    lengths are taken from it) or a JSON file: a list of points, or an object with ``points`` (each with
    ``concurrency``, ``tokens_per_s_per_agent`` and optionally ``output_tokens_per_s_per_gpu`` and
    ``decode_only``: speeds measured while decoding alone, compared with the decode step without the
    co-located prefill share) and an optional ``context``."""
    path = Path(path)
    if path.is_dir():
        rows, meta = _sweep_folder(path)
        lengths = {k: int(meta[k]) for k in ("input_len", "output_len") if isinstance(meta.get(k), (int, float))}
        base = replace(base, prompt_len=max(lengths.get("input_len", base.prompt_len), 1),
                       output_len=max(lengths.get("output_len", base.output_len), 1))
    else:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError("--calibrate", f"cannot read {path}: {exc}") from None
        meta = data if isinstance(data, dict) else {}
        rows = data.get("points") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows:
        raise PlanError("--calibrate", "expected a non-empty list of points (or an object with 'points')")
    if isinstance(meta.get("context"), int):
        base = replace(base, context=meta["context"])
    return [_measured(row, i, base) for i, row in enumerate(rows)]


def _measured(row: object, i: int, base: PlanInputs) -> Measured:
    """One point, checked."""
    if not isinstance(row, dict):
        raise PlanError(f"--calibrate points[{i}]", "must be an object")
    conc, agent = row.get("concurrency"), row.get("tokens_per_s_per_agent")
    gpu = row.get("output_tokens_per_s_per_gpu")
    if not isinstance(conc, int) or isinstance(conc, bool) or conc < 1:
        raise PlanError(f"--calibrate points[{i}].concurrency", f"must be an integer >= 1, got {conc!r}")
    if not isinstance(agent, (int, float)) or agent <= 0:
        raise PlanError(f"--calibrate points[{i}].tokens_per_s_per_agent", f"must be > 0, got {agent!r}")
    if gpu is not None and (not isinstance(gpu, (int, float)) or gpu <= 0):
        raise PlanError(f"--calibrate points[{i}].output_tokens_per_s_per_gpu", f"must be > 0, got {gpu!r}")
    decode_only = row.get("decode_only", False)
    if not isinstance(decode_only, bool):
        raise PlanError(f"--calibrate points[{i}].decode_only", f"must be true or false, got {decode_only!r}")
    return Measured(replace(base, concurrency=conc), float(agent), float(gpu) if gpu else None, decode_only)
