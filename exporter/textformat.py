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


# The exporter's own series (a few dozen, the same on every scrape) are written once; bounded all the same.
_own_series = functools.lru_cache(maxsize=1024)(_series)


def sample_lines(index: int, uuid: str, values: Values, previous: tuple[Values, tuple[bytes, ...]] | None = None,
                 texts: dict[tuple[str, tuple[str, ...]], str] | None = None) -> tuple[bytes, ...]:
    """One GPU's sample lines, one entry per GPU_METRICS family (b"" where it has none). `previous`:
    the same GPU's last (values, lines); a family whose series are unchanged keeps its lines (static
    readings, and those of collectors that did not run this sample, are not formatted again).
    `texts`: the series (name and labels) written for `previous`, replaced in place by those written
    now: a family that changes at every sample only formats its values, and the dict never holds more
    than the GPU's series (processes come and go)."""
    old_values, old_lines = previous or ({}, ())
    known = dict(texts) if texts and previous is not None else {}
    if texts is not None:
        texts.clear()
    gpu = (str(index), uuid)
    out = []
    for i, spec in enumerate(GPU_METRICS):
        series = values.get(spec.name)
        if previous is not None and (series is (old := old_values.get(spec.name)) or series == old):
            out.append(old_lines[i])  # the same dict (its collector did not run), or equal series
        elif series:
            names, lines = GPU_LABELS + spec.labels, []
            for labels, value in series.items():
                key = (spec.name, labels)
                text = known.get(key) or _series(spec.name, tuple(sorted(zip(names, gpu + labels))))
                if texts is not None:
                    texts[key] = text
                lines.append(f"{text} {floatToGoString(value)}\n")
            out.append("".join(lines).encode())
        else:
            out.append(b"")
    return tuple(out)
