"""The post-mortem figure (matplotlib): record panels and GPU panels on one step axis, time on top."""
from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from typing import Any

from trainer_hook.text import one_line

from .summary import RECORD_PANELS, RunSummary

TITLES = {"loss": "loss", "grad_norm": "grad norm", "learning_rate": "learning rate",
          "data_wait_share": "data-wait share of step time", "step_time_seconds": "step time (s)",
          "gpu_utilization": "GPU utilization", "gpu_memory": "GPU memory used (bytes)",
          "gpu_power": "GPU power (W)"}
NONFINITE_COLOR = "#d62728"
#: Record text in the figure (run names, batch ids) is cut to this many characters.
MAX_TEXT = 120


@dataclass
class GpuLine:
    """One GPU series from Prometheus, already mapped onto a run's steps."""

    panel: str
    label: str
    steps: list[float]
    values: list[float]


def build_figure(summaries: list[RunSummary], gpu_lines: list[GpuLine]) -> Any:
    """A matplotlib Figure: one panel per series that has data, shared step axis.

    Every text is drawn as written: "$" in a run name or a batch id from a record is not mathtext.
    """
    import matplotlib
    matplotlib.use("Agg")
    with matplotlib.rc_context({"text.parse_math": False}):
        return _figure(summaries, gpu_lines)


def _figure(summaries: list[RunSummary], gpu_lines: list[GpuLine]) -> Any:
    import matplotlib
    from matplotlib.figure import Figure
    panels = [name for name in RECORD_PANELS if any(len(s.series[name]) for s in summaries)]
    panels += [name for name in ("gpu_utilization", "gpu_memory", "gpu_power")
               if any(line.panel == name for line in gpu_lines)]
    if not panels:
        panels = ["loss"]
    figure = Figure(figsize=(11, 2.1 * len(panels) + 0.8), layout="constrained")
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    several = len(summaries) > 1
    for index, summary in enumerate(summaries):
        color = colors[index % len(colors)]
        label = _text(summary.run.name)
        for axis, panel in zip(axes, panels):
            series = summary.series.get(panel)
            if series is not None and len(series):
                xs, ys = series.points()
                axis.plot(xs, ys, color=color, linewidth=0.9, label=label if several else None)
        if summary.first_nonfinite is not None:
            step, batch, _ = summary.first_nonfinite
            for axis in axes:
                axis.axvline(step, color=NONFINITE_COLOR, linestyle="--", linewidth=1)
            axes[0].annotate(f"first non-finite: step {step}, batch {_text(str(batch))}", xy=(step, 1),
                             xycoords=("data", "axes fraction"), xytext=(4, -12),
                             textcoords="offset points", color=NONFINITE_COLOR, fontsize=8)
    for line in gpu_lines:
        axis = axes[panels.index(line.panel)]
        axis.plot(line.steps, line.values, linewidth=0.9, label=line.label)
    for axis, panel in zip(axes, panels):
        axis.set_ylabel(TITLES[panel], fontsize=8)
        axis.grid(True, alpha=0.3)
        _scale(axis, panel, summaries)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("step")
    _time_axis(axes[0], summaries[0])
    return figure


def _scale(axis: Any, panel: str, summaries: list[RunSummary]) -> None:
    """Log y for loss and grad norm when they span orders of magnitude (explosions stay readable)."""
    if panel not in ("loss", "grad_norm"):
        return
    values = [y for s in summaries for y in s.series[panel].points()[1]]
    if values and min(values) > 0 and max(values) / min(values) > 100:
        axis.set_yscale("log")


def _time_axis(axis: Any, summary: RunSummary) -> None:
    """Time since the first step of `summary` on the top edge, through its step clock.

    Only for a clock that moves forward with the steps (a record's steps and times need not: then
    there is no time axis rather than a meaningless one).
    """
    import numpy
    steps, times = summary.clock.points()
    if len(steps) < 2 or summary.first_time is None:
        return
    steps_array = numpy.asarray(steps, dtype=float)
    times_array = numpy.asarray(times, dtype=float)
    if not (numpy.all(numpy.diff(steps_array) > 0) and numpy.all(numpy.diff(times_array) > 0)):
        return
    span = times[-1] - summary.first_time
    unit, seconds = ("seconds", 1.0) if span < 120 else ("minutes", 60.0) if span < 3 * 3600 else ("hours", 3600.0)
    elapsed = (times_array - summary.first_time) / seconds
    top = axis.secondary_xaxis("top", functions=(_extrapolating(steps_array, elapsed),
                                                 _extrapolating(elapsed, steps_array)))
    top.set_xlabel(f"{unit} since the first step of {_text(summary.run.name)}", fontsize=8)


def _extrapolating(xs: Any, ys: Any) -> Any:
    """Piecewise-linear x -> y through the points (xs, ys strictly increasing), continued linearly
    past both ends: strictly increasing over any x range (clamping would give a zero-width top axis
    where the panels' steps lie outside the clock)."""
    import numpy
    low = (ys[1] - ys[0]) / (xs[1] - xs[0])
    high = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])

    def mapped(x: Any) -> Any:
        x = numpy.asarray(x, dtype=float)
        return numpy.where(x < xs[0], ys[0] + (x - xs[0]) * low,
                           numpy.where(x > xs[-1], ys[-1] + (x - xs[-1]) * high, numpy.interp(x, xs, ys)))
    return mapped


def svg_text(figure: Any) -> str:
    """The figure as an <svg> element to inline in HTML (text kept as text: small and searchable)."""
    import matplotlib
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}), _quiet_glyphs():
        figure.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    return svg[svg.find("<svg"):]


def save_png(figure: Any, path: Any) -> None:
    """The figure as a PNG file."""
    with _quiet_glyphs():
        figure.savefig(path, dpi=110)


def _text(value: str) -> str:
    """Record text as drawn: control characters as spaces, at most MAX_TEXT characters."""
    value = one_line(value, blank=True)
    return value if len(value) <= MAX_TEXT else value[:MAX_TEXT - 1] + "…"


@contextlib.contextmanager
def _quiet_glyphs() -> Any:
    """A character of a record that the font lacks is drawn as a box, without a warning on stderr."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from", category=UserWarning)
        yield
