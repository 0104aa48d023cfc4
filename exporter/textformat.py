"""Sample lines of the Prometheus text format, written as prometheus_client writes them.

Shared by the sampler (each GPU's lines are rendered once, when its sample is taken) and the scrape
path (`exposition`), which joins them under HELP/TYPE headers. The lines are the same in the text
format 0.0.4 and OpenMetrics 1.0 for gauges and for counters whose samples end in `_total`.
"""
from __future__ import annotations

import functools
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
    return f"{_own_series(name, tuple(labels))} {floatToGoString(value)}\n"


def _series(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    """A sample line up to its value: the name and the escaped labels."""
    pairs = ",".join(f'{key}="{escape(text)}"' for key, text in labels)
    return f"{name}{{{pairs}}}" if pairs else name


# Each series is written once: a sample or a scrape then only formats the values. Bounded: processes
# come and go. The exporter's own series (a few dozen, written on every scrape) and the GPUs' (about
# 70 a GPU, more with its processes; labels sorted once) are cached apart.
_own_series = functools.lru_cache(maxsize=1024)(_series)


@functools.lru_cache(maxsize=4096)
def _gpu_series(name: str, names: tuple[str, ...], values: tuple[str, ...]) -> str:
    return _series(name, tuple(sorted(zip(names, values))))


def sample_lines(index: int, uuid: str, values: Values,
                 previous: tuple[Values, tuple[bytes, ...]] | None = None) -> tuple[bytes, ...]:
    """One GPU's sample lines, one entry per GPU_METRICS family (b"" where it has none). `previous`:
    the same GPU's last (values, lines); a family whose series are unchanged keeps its lines (static
    readings, and those of collectors that did not run this sample, are not formatted again)."""
    old_values, old_lines = previous or ({}, ())
    gpu = (str(index), uuid)
    out = []
    for i, spec in enumerate(GPU_METRICS):
        series = values.get(spec.name)
        if previous is not None and (series is (old := old_values.get(spec.name)) or series == old):
            out.append(old_lines[i])  # the same dict (its collector did not run), or equal series
        elif series:
            names = GPU_LABELS + spec.labels
            out.append("".join(f"{_gpu_series(spec.name, names, gpu + labels)} {floatToGoString(value)}\n"
                               for labels, value in series.items()).encode())
        else:
            out.append(b"")
    return tuple(out)
