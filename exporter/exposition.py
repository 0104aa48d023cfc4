"""The scrape side: what the telemetry path serves, from the sampler's latest snapshot.

A scrape never calls NVML and never waits for a sampler: it reads one immutable Snapshot reference
and the counters. Two ways produce the same bytes:
- `SnapshotCollector`, a prometheus_client collector: the reference, and what `name[]` filtering uses.
- `Exposition.render`, the scrape path: each GPU's sample lines are rendered once, by its sampler
  thread when the sample is taken (`textformat.sample_lines`); a scrape joins them under HELP/TYPE headers that
  prometheus_client rendered at start-up, writes our few dozen other samples (`nvml_up`, identity,
  self-metrics) with the same line writer, and leaves only the process and platform collectors to
  prometheus_client. Formatting ~500 GPU samples with prometheus_client was ~85 % of a scrape.
Sample lines are the same in the Prometheus text format 0.0.4 and OpenMetrics 1.0 (gauges, and
counters whose samples end in `_total`); only the HELP/TYPE headers differ.
A scrape never raises: if building the families fails, the failure is logged and only the exporter's
own metrics are served.
"""
from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from exporter import __version__
from exporter.metrics import (BUILD_INFO, COLLECTOR_DURATION, COLLECTOR_SUCCESS, COUNTER, DRIVER_INFO, ERRORS,
                              GPU_LABELS, GPU_LOST, GPU_LOST_TOTAL, GPU_METRICS, GPU_SAMPLE_AGE, HOST_PID_NAMESPACE,
                              NVML_CALLS, SNAPSHOT_AGE, UP, MetricSpec)
from exporter.textformat import gpu_series, line

if TYPE_CHECKING:
    from exporter.sampler import GpuSample, Sampler, Snapshot

log = logging.getLogger(__name__)

_OPENMETRICS = "application/openmetrics-text"
_EOF = b"# EOF\n"


def _family_name(spec: MetricSpec) -> str:
    """The name of a spec's metric family: counters lose their `_total` (their samples get it back)."""
    return spec.name.removesuffix("_total") if spec.type == COUNTER else spec.name


def family(spec: MetricSpec, labels: tuple[str, ...] | None = None) -> Metric:
    """An empty metric family for a spec."""
    names = list(spec.labels if labels is None else labels)
    if spec.type == COUNTER:
        return CounterMetricFamily(_family_name(spec), spec.help, labels=names)
    return GaugeMetricFamily(spec.name, spec.help, labels=names)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


@dataclass(frozen=True)
class _View:
    """What one scrape serves: the snapshot, the time, and the samples not yet stale."""

    snapshot: Snapshot
    now: float
    fresh: list[GpuSample]


class _Families:
    """A fixed list of families, collectable like a registry."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


class SnapshotCollector:
    """Serves `sampler.store.current`; `clock` must be the sampler's clock."""

    def __init__(self, sampler: Sampler, clock: Callable[[], float] = time.monotonic) -> None:
        self.sampler = sampler
        self.clock = clock
        self._build = (__version__, platform.python_version(), _version("nvidia-ml-py"))

    def describe(self) -> list[Metric]:
        return []  # families depend on the hardware; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        try:
            view = self.view()
            families = self.head(view) + self.gpu_families(view) + self.tail(view.snapshot.samples, view.now)
        except Exception:  # noqa: BLE001 - a scrape must answer whatever happens
            log.exception("building the exposition failed; serving exporter metrics only")
            families = self.tail((), self.clock())
        yield from families

    def view(self) -> _View:
        snapshot = self.sampler.store.current
        now = self.clock()
        stale_after = self.sampler.hang_after
        return _View(snapshot, now, [s for s in snapshot.samples if now - s.taken_at <= stale_after])

    def head(self, view: _View) -> list[Metric]:
        """The families served before the per-GPU ones: up, driver and build identity, lost GPUs."""
        lost = family(GPU_LOST)
        for device in self.sampler.devices:
            lost.add_metric([str(device.index), device.uuid], 1.0 if device.index in view.snapshot.lost else 0.0)
        up = family(UP)
        # 1 on a host where NVML answers and reports no GPU at all; 0 where GPUs exist but none answers
        # (including GPUs that could not even be opened at start)
        up.add_metric([], 1.0 if view.fresh or self.sampler.nvml.device_count == 0 else 0.0)
        driver = family(DRIVER_INFO)
        driver.add_metric([self.sampler.driver_version, self.sampler.cuda_driver_version], 1.0)
        build = family(BUILD_INFO)
        build.add_metric(list(self._build), 1.0)
        return [up, driver, build, lost]

    def gpu_families(self, view: _View) -> list[Metric]:
        """The per-GPU families of the fresh samples (the reference for `sample_lines`)."""
        out = []
        for spec in GPU_METRICS:
            metric = family(spec, GPU_LABELS + spec.labels)
            for sample in view.fresh:
                for labels, value in gpu_series(spec, sample.index, sample.uuid, sample.values):
                    metric.add_metric(labels, value)
            if metric.samples:
                out.append(metric)
        return out

    def tail(self, samples: Sequence[GpuSample], now: float) -> list[Metric]:
        """The exporter's self-metrics over `samples` (stale ones included), served after the per-GPU families."""
        success, duration = family(COLLECTOR_SUCCESS), family(COLLECTOR_DURATION)
        for name in self.sampler.collectors:
            runs = [s.runs[name] for s in samples if name in s.runs]
            if runs:
                success.add_metric([name], float(all(run.success for run in runs)))
                duration.add_metric([name], sum(run.duration for run in runs))
        errors = family(ERRORS)
        for (collector, error), count in sorted(self.sampler.stats.errors().items()):
            errors.add_metric([collector, error], count)
        lost_total, losses = family(GPU_LOST_TOTAL), self.sampler.stats.losses()
        for device in self.sampler.devices:
            lost_total.add_metric([str(device.index), device.uuid], losses.get((str(device.index), device.uuid), 0))
        age, gpu_age = family(SNAPSHOT_AGE), family(GPU_SAMPLE_AGE)
        ages = [max(0.0, now - s.taken_at) for s in samples]
        for sample, sample_age in zip(samples, ages):
            gpu_age.add_metric([str(sample.index), sample.uuid], sample_age)
        if ages:
            age.add_metric([], max(ages))
        host_pids = []  # only with the processes collector, and where /proc says
        if self.sampler.host_pid_namespace is not None:
            host_pids.append(family(HOST_PID_NAMESPACE))
            host_pids[0].add_metric([], float(self.sampler.host_pid_namespace))
        calls = family(NVML_CALLS)
        calls.add_metric([], self.sampler.nvml_calls())
        return [success, duration, errors, lost_total, age, gpu_age, *host_pids, calls]


_FORMATS = {"text": generate_latest, _OPENMETRICS: openmetrics.generate_latest}
_OWN_SPECS = (UP, DRIVER_INFO, BUILD_INFO, GPU_LOST, *GPU_METRICS, COLLECTOR_SUCCESS, COLLECTOR_DURATION, ERRORS,
              GPU_LOST_TOTAL, SNAPSHOT_AGE, GPU_SAMPLE_AGE, HOST_PID_NAMESPACE, NVML_CALLS)


class Exposition:
    """Everything the telemetry path serves: the snapshot's families, then `others` (process, platform).

    `registry` holds them all, for the generic prometheus_client path (`name[]` filtering);
    `render(accept)` is the scrape path, with byte for byte the same output: the per-GPU lines come
    pre-rendered with the samples, our other families (a few dozen samples) are written here, and
    only `others` go through prometheus_client.
    """

    def __init__(self, sampler: Sampler, others: Iterable = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.collector = SnapshotCollector(sampler, clock)
        self.others = list(others)
        # the snapshot collector describes nothing (its families depend on the hardware): without this,
        # name[] filtering would find none of them
        self.registry = CollectorRegistry(support_collectors_without_names=True)
        for collector in [self.collector, *self.others]:
            self.registry.register(collector)
        # HELP/TYPE of each of our families (keyed by family name), per format, as prometheus_client writes them.
        self._headers = {fmt: {_family_name(spec): encoder(_Families([family(spec)])).removesuffix(_EOF)
                               for spec in _OWN_SPECS}
                         for fmt, encoder in _FORMATS.items()}

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition an Accept header negotiates, and its content type."""
        encoder, content_type = choose_encoder(accept)
        if "escaping=dots" in content_type:  # renames every metric: let prometheus_client do it
            return encoder(self.registry), content_type
        try:
            return self._render(encoder, content_type.startswith(_OPENMETRICS)), content_type
        except Exception:  # noqa: BLE001 - a bug here must not cost the scrape
            log.exception("fast exposition failed; rendering with prometheus_client")
            return encoder(self.registry), content_type

    def _render(self, encoder: Callable[[_Families], bytes], openmetrics_format: bool) -> bytes:
        headers = self._headers[_OPENMETRICS if openmetrics_format else "text"]
        view = self.collector.view()
        parts = [self._family(headers, metric) for metric in self.collector.head(view)]
        for i, spec in enumerate(GPU_METRICS):
            lines = [sample.lines[i] for sample in view.fresh if sample.lines[i]]
            if lines:
                parts.append(headers[_family_name(spec)])
                parts += lines
        parts += [self._family(headers, metric) for metric in self.collector.tail(view.snapshot.samples, view.now)]
        others = [metric for collector in self.others for metric in collector.collect()]
        parts.append(encoder(_Families(others)))  # ends with OpenMetrics' `# EOF`
        return b"".join(parts)

    @staticmethod
    def _family(headers: dict[str, bytes], metric: Metric) -> bytes:
        lines = "".join(line(s.name, sorted(s.labels.items()), s.value) for s in metric.samples)
        return headers[metric.name] + lines.encode()
