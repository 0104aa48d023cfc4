"""Sample lines of the Prometheus text format, written as prometheus_client writes them.

Shared by the sampler (each GPU's lines are rendered once, when its sample is taken) and the scrape
path (`exposition`), which joins them under HELP/TYPE headers. The lines are the same in the text
format 0.0.4 and OpenMetrics 1.0 for gauges and for counters whose samples end in `_total`.
"""
from __future__ import annotations

from typing import Iterable, Iterator

from prometheus_client.utils import floatToGoString

from exporter.metrics import GPU_LABELS, GPU_METRICS, MetricSpec

Values = dict[str, dict[tuple[str, ...], float]]


def gpu_series(spec: MetricSpec, index: int, uuid: str, values: Values) -> Iterator[tuple[list[str], float]]:
    """(label values in GPU_LABELS + spec.labels order, value) of one GPU's series of `spec`."""
    gpu = [str(index), uuid]
    for labels, value in values.get(spec.name, {}).items():
        yield gpu + list(labels), value


def escape(value: str) -> str:
    """A label value escaped as prometheus_client escapes it (backslash, newline, double quote)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def line(name: str, labels: Iterable[tuple[str, str]], value: float) -> str:
    """One sample line, as prometheus_client writes it in both formats; `labels` sorted by name."""
    pairs = ",".join(f'{key}="{escape(text)}"' for key, text in labels)
    return f"{name}{{{pairs}}} {floatToGoString(value)}\n" if pairs else f"{name} {floatToGoString(value)}\n"


def sample_lines(index: int, uuid: str, values: Values,
                 previous: tuple[Values, tuple[bytes, ...]] | None = None) -> tuple[bytes, ...]:
    """One GPU's sample lines, one entry per GPU_METRICS family (b"" where it has none). `previous`:
    the same GPU's last (values, lines); a family whose series are unchanged keeps its lines (static
    readings, and those of collectors that did not run this sample, are not formatted again)."""
    old_values, old_lines = previous or ({}, ())
    return tuple(old_lines[i] if previous is not None and _same(values.get(spec.name), old_values.get(spec.name)) else
                 "".join(line(spec.name, sorted(zip(GPU_LABELS + spec.labels, labels)), value)
                         for labels, value in gpu_series(spec, index, uuid, values)).encode()
                 for i, spec in enumerate(GPU_METRICS))


def _same(series: dict | None, old: dict | None) -> bool:
    """Whether a family's series are unchanged: the same dict (its collector did not run), or equal."""
    return series is old or series == old
