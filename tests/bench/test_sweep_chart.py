"""The sweep chart's axes: plain-number tick labels (no powers of ten, no offset) that do not run into each
other, whatever the range of the curves; and the note of a configuration without a planner curve."""

import re

import pytest

from flashserve.bench.chart import figure

PLAIN = re.compile(r"^-?[0-9][0-9,]*(\.[0-9]+)?$")


def _points(xy):
    return [{"concurrency": 2 ** i, "tokens_per_s_per_agent": x, "output_tokens_per_s_per_gpu": y,
             "cost_per_million_output_tokens": 0.5} for i, (x, y) in enumerate(xy)]


RANGES = {
    # one curve within a narrow band (the case that showed "2.6×10¹" minor labels on log axes)
    "narrow": ([(31.2, 30.1), (28.4, 55.0), (26.1, 98.2)], None),
    # measured and planner a decade apart
    "decade": ([(31.2, 30.1), (28.4, 55.0), (26.1, 98.2)], [(300, 280), (250, 500), (180, 900)]),
    # six decades, large throughputs and speeds below one token/s
    "wide": ([(0.5, 120000), (0.05, 1500000)], [(3000, 2), (1, 1e6)]),
    "one point": ([(12.5, 12.5)], None),
    "close values": ([(12.5, 12.5), (12.51, 12.52)], None),  # ticks a few thousandths apart: 12.500, 12.502, ...
    "large, linear": ([(1200, 1_500_000), (1800, 1_900_000)], None),
}


def _shown_labels(ax, axis):
    """The labels of the ticks inside the axis' view, with their drawn boxes."""
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    ticks = (ax.xaxis if axis == "x" else ax.yaxis).get_major_ticks()
    renderer = ax.figure.canvas.get_renderer()
    out = []
    for tick in ticks:
        pos = tick.get_loc()
        if lo <= pos <= hi and tick.label1.get_visible() and tick.label1.get_text():
            out.append((pos, tick.label1.get_text(), tick.label1.get_window_extent(renderer)))
    return out


@pytest.mark.parametrize("name", RANGES)
def test_tick_labels_are_plain_numbers_apart(name):
    measured, predicted = RANGES[name]
    summary = {"configurations": {"ours": {"measured": _points(measured),
                                           "predicted": _points(predicted) if predicted else None}}}
    fig = figure(summary)
    fig.canvas.draw()
    ax = fig.axes[0]
    for axis in ("x", "y"):
        labels = _shown_labels(ax, axis)
        assert len(labels) >= 2, (axis, labels)
        for pos, text, _ in labels:
            assert PLAIN.match(text), (axis, text)  # no "×10", "$10^{1}$", "1e3"
            assert float(text.replace(",", "")) == pytest.approx(pos, rel=1e-6, abs=1e-9), (axis, text, pos)
        for (_, a, box_a), (_, b, box_b) in zip(labels, labels[1:]):
            assert not box_a.overlaps(box_b), (axis, a, b)
        minor = (ax.xaxis if axis == "x" else ax.yaxis).get_minorticklabels()
        assert all(not t.get_text() for t in minor), axis
        assert (ax.xaxis if axis == "x" else ax.yaxis).get_offset_text().get_text() == ""


def test_the_reason_for_a_missing_planner_curve_is_on_the_chart():
    note = "no planner curve: the server's hardware is not known"
    fig = figure({"configurations": {"srv": {"measured": _points([(20, 20), (15, 30)]), "predicted": None,
                                             "predicted_note": note}}})
    assert any(note in t.get_text() for t in fig.texts)
