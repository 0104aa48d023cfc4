"""The scrape side: what the telemetry path serves, from the sampler's latest snapshot.

A scrape never calls NVML and never waits for a sampler: it reads one immutable GpuSnapshot reference
and the counters. The exposition is written by the exporter itself (`textformat`), byte for byte as
prometheus_client 0.26 writes the same families, which the daemon never imports for an ordinary scrape:
- each GPU's sample lines are rendered once, by its sampler thread when the sample is taken
  (`textformat.sample_lines`); a scrape joins them under HELP/TYPE headers written at start-up,
  writes our few dozen other samples (`nvml_up`, identity, self-metrics) and the process_* and
  python_info series (`processmetrics`) with the same line writer;
- a rendered body (and its gzip) is reused by the scrapes that ask for the same format while the
  snapshot is the same, for at most REUSE_SECONDS: the self-metrics (snapshot and sample ages) and
  process_* of such a scrape are those of the moment the body was rendered;
- `GpuSnapshotCollector`, a prometheus_client collector over the same families, is the reference, and
  prometheus_client (imported then) serves what is rare: `name[]`-filtered scrapes, `escaping=dots`
  (which renames every metric) and, should rendering fail, the fallback.
Sample lines are the same in the Prometheus text format 0.0.4 and OpenMetrics 1.0 (gauges, and
counters whose samples end in `_total`); only the HELP/TYPE headers differ.
A scrape never raises: if building the families fails, the failure is logged and only the exporter's
own metrics are served.
"""
from __future__ import annotations

import functools
import logging
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from exporter import __version__
from exporter.metrics import (
    BUILD_INFO,
    COLLECTOR_DURATION,
    COLLECTOR_SUCCESS,
    COUNTER,
    DRIVER_INFO,
    ERRORS,
    GPU_LABELS,
    GPU_LOST,
    GPU_LOST_TOTAL,
    GPU_METRICS,
    GPU_SAMPLE_AGE,
    HOST_PID_NAMESPACE,
    NVML_CALLS,
    PROCESS_METRICS,
    PYTHON_INFO,
    SNAPSHOT_AGE,
    UP,
    MetricSpec,
)
from exporter.processmetrics import ProcessMetrics
from exporter.textformat import EOF, compress, gpu_series, header, line, negotiate

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from exporter.sampler import GpuSample, GpuSnapshot, Sampler

log = logging.getLogger(__name__)

# The longest a rendered body is served again to scrapes of the same snapshot and format.
REUSE_SECONDS = 1.0


class Family(NamedTuple):
    """A metric family as the exporter writes it: its spec, label names and (label values, value) series."""

    spec: MetricSpec
    labels: tuple[str, ...]
    series: list[tuple[tuple[str, ...], float]]


def _family(spec: MetricSpec, series: list[tuple[tuple[str, ...], float]] | None = None) -> Family:
    return Family(spec, spec.labels, [] if series is None else series)


def metric(family: Family) -> Metric:
    """A family as a prometheus_client metric family (imported here: only the rare paths need it)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    spec = family.spec
    out: Metric
    if spec.type == COUNTER:
        out = CounterMetricFamily(spec.name.removesuffix("_total"), spec.help, labels=list(family.labels))
    else:
        out = GaugeMetricFamily(spec.name, spec.help, labels=list(family.labels))
    for labels, value in family.series:
        out.add_metric(list(labels), value)
    return out


def render_registry(registry, accept: str | None, names: Sequence[str] = (),
                    gzipped: bool = False) -> tuple[bytes, str]:
    """`registry` (restricted to the families `names`, if any) rendered by prometheus_client in the format
    an Accept header asks for (`negotiate`, as the fast path reads it), gzipped or not, and its content type."""
    fmt = negotiate(accept)
    # Every name here is a legacy name, which "values" leaves as it is; prometheus_client 0.26's OpenMetrics
    # writer gives each sample name a U__ prefix under "values" (not its family's): "underscores" is that text.
    escaping = "underscores" if fmt.escaping == "values" else fmt.escaping
    encoder: Callable[[object], bytes]
    if fmt.openmetrics:
        from prometheus_client.openmetrics import exposition as openmetrics_exposition
        encoder = functools.partial(openmetrics_exposition.generate_latest, escaping=escaping, version="1.0.0")
    else:
        from prometheus_client import exposition as text_exposition
        encoder = functools.partial(text_exposition.generate_latest, escaping=escaping)
    if names and hasattr(registry, "restricted_registry"):
        registry = registry.restricted_registry(names)
    body = encoder(registry)
    return compress(body) if gzipped else body, fmt.content_type


def installed_version(distribution: str) -> str:
    """An installed distribution's version, from the name of its `.dist-info` directory on sys.path
    (`{name}-{version}.dist-info`, the wheel's layout); "" when there is none. Not importlib.metadata,
    which loads the `email` package and more: 4 MB of resident memory for one string."""
    prefix = re.sub(r"[-_.]+", "_", distribution).lower() + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in sorted(names):
            if name.lower().startswith(prefix) and name.endswith(".dist-info"):
                return name[len(prefix):-len(".dist-info")]
    return ""


@dataclass(frozen=True)
class _View:
    """What one scrape serves: the snapshot, the time, and the samples not yet stale."""

    snapshot: GpuSnapshot
    now: float
    fresh: list[GpuSample]


class GpuSnapshotCollector:
    """Serves `sampler.store.current`; `clock` must be the sampler's clock. A prometheus_client collector
    (`collect`), and the families the scrape path writes itself (`head`, `gpu_families`, `tail`)."""

    def __init__(self, sampler: Sampler, clock: Callable[[], float] = time.monotonic) -> None:
        self.sampler = sampler
        self.clock = clock
        self._build = (__version__, platform.python_version(), installed_version("nvidia-ml-py"))

    def describe(self) -> list[Metric]:
        return []  # families depend on the hardware; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        try:
            view = self.view()
            families = self.head(view) + self.gpu_families(view) + self.tail(view.snapshot.samples, view.now)
        except Exception:  # a scrape must answer whatever happens
            log.exception("building the exposition failed; serving exporter metrics only")
            families = self.tail((), self.clock())
        yield from map(metric, families)

    def view(self, snapshot: GpuSnapshot | None = None) -> _View:
        snapshot = self.sampler.store.current if snapshot is None else snapshot
        now = self.clock()
        stale_after = self.sampler.hang_after
        return _View(snapshot, now, [s for s in snapshot.samples if now - s.taken_at <= stale_after])

    def head(self, view: _View) -> list[Family]:
        """The families served before the per-GPU ones: up, driver and build identity, lost GPUs."""
        lost = _family(GPU_LOST, [((str(device.index), device.uuid), 1.0 if device.index in view.snapshot.lost else 0.0)
                                  for device in self.sampler.devices])
        # 1 on a host where NVML answers and reports no GPU at all; 0 where GPUs exist but none answers
        # (including GPUs that could not even be opened at start)
        up = _family(UP, [((), 1.0 if view.fresh or self.sampler.nvml.device_count == 0 else 0.0)])
        driver = _family(DRIVER_INFO, [((self.sampler.driver_version, self.sampler.cuda_driver_version), 1.0)])
        return [up, driver, _family(BUILD_INFO, [(self._build, 1.0)]), lost]

    def gpu_families(self, view: _View) -> list[Family]:
        """The per-GPU families of the fresh samples (the reference for `sample_lines`)."""
        out = []
        for spec in GPU_METRICS:
            series = [(tuple(labels), value) for sample in view.fresh
                      for labels, value in gpu_series(spec, sample.index, sample.uuid, sample.values)]
            if series:
                out.append(Family(spec, GPU_LABELS + spec.labels, series))
        return out

    def tail(self, samples: Sequence[GpuSample], now: float) -> list[Family]:
        """The exporter's self-metrics over `samples` (stale ones included), served after the per-GPU families."""
        success, duration = _family(COLLECTOR_SUCCESS), _family(COLLECTOR_DURATION)
        for name in self.sampler.collectors:
            runs = [s.runs[name] for s in samples if name in s.runs]
            if runs:
                success.series.append(((name,), float(all(run.success for run in runs))))
                duration.series.append(((name,), sum(run.duration for run in runs)))
        errors = _family(ERRORS, [(key, count) for key, count in sorted(self.sampler.stats.errors().items())])
        losses = self.sampler.stats.losses()
        lost_total = _family(GPU_LOST_TOTAL, [((str(device.index), device.uuid),
                                               losses.get((str(device.index), device.uuid), 0))
                                              for device in self.sampler.devices])
        ages = [max(0.0, now - s.taken_at) for s in samples]
        gpu_age = _family(GPU_SAMPLE_AGE, [((str(s.index), s.uuid), age) for s, age in zip(samples, ages)])
        age = _family(SNAPSHOT_AGE, [((), max(ages))] if ages else [])
        host_pids = []  # only with the processes collector, and where /proc says
        if self.sampler.host_pid_namespace is not None:
            host_pids.append(_family(HOST_PID_NAMESPACE, [((), float(self.sampler.host_pid_namespace))]))
        calls = _family(NVML_CALLS, [((), self.sampler.nvml_calls())])
        return [success, duration, errors, lost_total, age, gpu_age, *host_pids, calls]


_OWN_SPECS = (UP, DRIVER_INFO, BUILD_INFO, GPU_LOST, *GPU_METRICS, COLLECTOR_SUCCESS, COLLECTOR_DURATION, ERRORS,
              GPU_LOST_TOTAL, SNAPSHOT_AGE, GPU_SAMPLE_AGE, HOST_PID_NAMESPACE, NVML_CALLS, *PROCESS_METRICS,
              PYTHON_INFO)


class _Rendered(NamedTuple):
    snapshot: GpuSnapshot
    at: float
    body: bytes


class Exposition:
    """Everything the telemetry path serves: the snapshot's families, then process_* and python_info.

    `render(accept, names, gzipped)` is the scrape path (`reused`: its answer when no rendering is
    needed, for the connection's own thread to serve without waiting for the rendering thread).
    `registry`, built (with prometheus_client) the first time it is used, holds the same collectors as
    prometheus_client has them: the reference, and what `name[]` filtering and `escaping=dots` render.
    `proc`: where process_* are read (/proc/self).
    """

    def __init__(self, sampler: Sampler, clock: Callable[[], float] = time.monotonic, proc: str = "/proc") -> None:
        self.collector = GpuSnapshotCollector(sampler, clock)
        self.process = ProcessMetrics(proc)
        self._proc = proc
        self._registry = None
        # HELP/TYPE of each of our families (keyed by name), per format (OpenMetrics or not).
        self._headers = {openmetrics: {spec.name: header(spec, openmetrics) for spec in _OWN_SPECS}
                         for openmetrics in (False, True)}
        self._rendered: dict[tuple[bool, bool], _Rendered] = {}

    @property
    def registry(self):
        """The prometheus_client registry of the same collectors (ProcessCollector and PlatformCollector)."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
            # the snapshot collector describes nothing (its families depend on the hardware): without this,
            # name[] filtering would find none of them
            registry = CollectorRegistry(support_collectors_without_names=True)
            for collector in (self.collector, ProcessCollector(proc=self._proc, registry=None),
                              PlatformCollector(registry=None)):
                registry.register(collector)
            self._registry = registry
        return self._registry

    def render(self, accept: str | None, names: Sequence[str] = (), gzipped: bool = False) -> tuple[bytes, str]:
        """The exposition an Accept header negotiates (only the families `names`, if any), gzipped or not,
        and its content type."""
        fmt = negotiate(accept)
        if names or fmt.escaping == "dots":  # rare: let prometheus_client do it
            return render_registry(self.registry, accept, names, gzipped)
        snapshot, now = self.collector.sampler.store.current, self.collector.clock()
        reused = self._reusable(fmt.openmetrics, gzipped, snapshot, now)
        if reused is not None:
            return reused, fmt.content_type
        try:
            body = self._render(self.collector.view(snapshot), fmt.openmetrics)
        except Exception:  # a scrape must answer whatever happens
            log.exception("fast exposition failed; rendering with prometheus_client")
            return render_registry(self.registry, accept, (), gzipped)
        body = compress(body) if gzipped else body
        self._rendered[(fmt.openmetrics, gzipped)] = _Rendered(snapshot, now, body)
        return body, fmt.content_type

    def reused(self, accept: str | None, names: Sequence[str] = (), gzipped: bool = False) -> tuple[bytes, str] | None:
        """What `render` would answer when it can serve a body rendered before (cheap: any thread may ask);
        None when the scrape needs a rendering."""
        fmt = negotiate(accept)
        if names or fmt.escaping == "dots":
            return None
        body = self._reusable(fmt.openmetrics, gzipped, self.collector.sampler.store.current, self.collector.clock())
        return None if body is None else (body, fmt.content_type)

    def _reusable(self, openmetrics: bool, gzipped: bool, snapshot: GpuSnapshot, now: float) -> bytes | None:
        """The body rendered in this format for `snapshot` less than REUSE_SECONDS before `now`, if any."""
        rendered = self._rendered.get((openmetrics, gzipped))
        if rendered is not None and rendered.snapshot is snapshot and 0 <= now - rendered.at < REUSE_SECONDS:
            return rendered.body
        return None

    def _render(self, view: _View, openmetrics: bool) -> bytes:
        headers = self._headers[openmetrics]
        parts = [self._text(headers, family) for family in self.collector.head(view)]
        for i, spec in enumerate(GPU_METRICS):
            lines = [sample.lines[i] for sample in view.fresh if sample.lines[i]]
            if lines:
                parts.append(headers[spec.name])
                parts += lines
        parts += [self._text(headers, family) for family in self.collector.tail(view.snapshot.samples, view.now)]
        parts += [self._text(headers, _family(spec, series)) for spec, series in self.process.families()]
        if openmetrics:
            parts.append(EOF)
        return b"".join(parts)

    @staticmethod
    def _text(headers: dict[str, bytes], family: Family) -> bytes:
        name, labels = family.spec.name, family.labels
        lines = "".join(line(name, sorted(zip(labels, values)), value) for values, value in family.series)
        return headers[name] + lines.encode()
