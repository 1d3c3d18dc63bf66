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


def draw(summary: dict[str, Any], png: Path) -> Path:
    """Draw every configuration of a ``sweep.json`` summary into ``png`` (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    plotted = 0
    for i, (label, entry) in enumerate(sorted(summary["configurations"].items())):
        colour = colours[i % len(colours)]
        for points, style, kind in ((entry["measured"], "o-", "measured"), (entry.get("predicted") or [], "s--", "planner")):
            x, y = _xy(points)
            if x:
                ax.plot(x, y, style, color=colour, alpha=1.0 if kind == "measured" else 0.6, label=f"{label} ({kind})")
                plotted += len(x)
        _label_points(ax, entry["measured"])
    if plotted:
        ax.set_xscale("log")  # measured and predicted curves can sit a decade apart before calibration
        ax.set_yscale("log")
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
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
