"""The sweep chart: tokens/s per agent against output tokens/s per device, measured and predicted."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _xy(points: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """The plotted coordinates: points with a speed, planner points that do not fit left out."""
    kept = [p for p in points if p.get("tokens_per_s_per_agent") and p.get("fits", True)]
    return [p["tokens_per_s_per_agent"] for p in kept], [p["output_tokens_per_s_per_gpu"] for p in kept]


def _label_points(ax: Any, points: list[dict[str, Any]]) -> None:
    for p in points:
        if not p.get("tokens_per_s_per_agent"):
            continue
        cost = p.get("cost_per_million_output_tokens")
        text = f"c={p['concurrency']}" + (f", ${cost:.3g}/M" if cost is not None else "")
        ax.annotate(text, (p["tokens_per_s_per_agent"], p["output_tokens_per_s_per_gpu"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")


def _notes(summary: dict[str, Any]) -> list[str]:
    """One line per configuration whose planner curve left levels out (or failed) or whose levels served
    nothing."""
    lines = []
    for label, entry in sorted(summary["configurations"].items()):
        left = [str(m["concurrency"]) for m in entry.get("predicted_misfits") or []]
        left += [str(p["concurrency"]) for p in entry.get("predicted") or [] if p.get("fits") is False]
        if left:
            lines.append(f"{label}: planner points left out, deployment does not fit at c={', '.join(left)}")
        elif entry.get("predicted") is None and entry.get("predicted_note"):
            lines.append(f"{label}: {entry['predicted_note']}")
        if entry.get("failed_levels"):
            lines.append(f"{label}: no request completed at c={', '.join(map(str, entry['failed_levels']))}")
    return lines


def plain_number(value: float, _pos: object = None) -> str:
    """A log axis' tick label (1, 2 or 5 x 10^k) as a plain number: ``0.05``, ``20``, ``1,000``."""
    import numpy as np

    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return np.format_float_positional(value, precision=3, fractional=False, trim="-")


def _linear_formatter() -> Any:
    """Plain labels for a linear axis: every tick with the fewest decimals that write each one exactly
    (``26``, ``26.5``, ``12.502``, ``1,500``), no offset and no power of ten."""
    from matplotlib.ticker import Formatter

    class Plain(Formatter):
        decimals = 0

        def set_locs(self, locs):
            super().set_locs(locs)
            span = (max(locs) - min(locs)) if len(locs) > 1 else abs(locs[0]) if len(locs) else 1.0
            tol = 1e-6 * (span or 1.0)
            self.decimals = next((d for d in range(12) if all(abs(round(v, d) - v) <= tol for v in locs)), 12)

        def __call__(self, x, pos=None):
            text = f"{x:,.{self.decimals}f}"
            return "0" if float(text.replace(",", "")) == 0 else text  # no "-0"

    return Plain()


def _scale(ax: Any, which: str, values: list[float]) -> None:
    """Axis ``which`` ("x" or "y"): log where the values span a decade or more (measured and predicted curves
    can sit a decade apart), linear otherwise; ticks at 1, 2, 5 x 10^k (10^k over many decades) or at round
    linear steps, labelled as plain numbers; minor ticks unlabelled."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    lo, hi = min(values), max(values)
    if lo > 0 and hi / lo >= 10:
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
        subs = (1.0, 2.0, 5.0) if math.log10(hi / lo) <= 2.5 else (1.0,)
        axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=9))
        axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(2, 10)), numticks=12))
        axis.set_major_formatter(FuncFormatter(plain_number))
    else:
        axis.set_major_locator(MaxNLocator(nbins=6))
        axis.set_major_formatter(_linear_formatter())
    axis.set_minor_formatter(NullFormatter())


def figure(summary: dict[str, Any]) -> Any:
    """The chart of every configuration of a ``sweep.json`` summary, as a matplotlib figure (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xs: list[float] = []
    ys: list[float] = []
    for i, (label, entry) in enumerate(sorted(summary["configurations"].items())):
        colour = colours[i % len(colours)]
        for points, style, kind in ((entry["measured"], "o-", "measured"), (entry.get("predicted") or [], "s--", "planner")):
            x, y = _xy(points)
            if x:
                ax.plot(x, y, style, color=colour, alpha=1.0 if kind == "measured" else 0.6, label=f"{label} ({kind})")
                xs += x
                ys += y
        _label_points(ax, entry["measured"])
    if xs:
        _scale(ax, "x", xs)
        _scale(ax, "y", ys)
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no point to draw", ha="center", transform=ax.transAxes)
    ax.set_xlabel("tokens/s per agent (1000 / median TPOT)")
    ax.set_ylabel("output tokens/s per device")
    ax.set_title("per-agent speed against throughput per device", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    notes = _notes(summary)
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, min(0.035 * len(notes), 0.4), 1, 1))
    return fig


def draw(summary: dict[str, Any], png: Path) -> Path:
    """Draw every configuration of a ``sweep.json`` summary into ``png``."""
    import matplotlib.pyplot as plt

    fig = figure(summary)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
