"""The scrape side: a prometheus_client collector that serves the latest snapshot.

A scrape never calls NVML and never waits for a sampler: it reads one immutable Snapshot reference
and the counters, and turns them into metric families. It never raises either: if building the
families fails, the failure is logged and only the exporter's own metrics are served.
"""
from __future__ import annotations

import logging
import platform
import time
from importlib import metadata
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter import __version__
from exporter.metrics import (BUILD_INFO, COLLECTOR_DURATION, COLLECTOR_SUCCESS, COUNTER, DRIVER_INFO, ERRORS,
                              GPU_LABELS, GPU_LOST, GPU_LOST_TOTAL, GPU_METRICS, GPU_SAMPLE_AGE, NVML_CALLS,
                              SNAPSHOT_AGE, UP, MetricSpec)
from exporter.sampler import GpuSample, Sampler

log = logging.getLogger(__name__)


def family(spec: MetricSpec, labels: tuple[str, ...] | None = None) -> Metric:
    """An empty metric family for a spec (counters lose their `_total` here and get it back on output)."""
    names = list(spec.labels if labels is None else labels)
    if spec.type == COUNTER:
        return CounterMetricFamily(spec.name.removesuffix("_total"), spec.help, labels=names)
    return GaugeMetricFamily(spec.name, spec.help, labels=names)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


class SnapshotCollector:
    """Serves `sampler.store.current`; `clock` must be the sampler's clock."""

    def __init__(self, sampler: Sampler, clock: Callable[[], float] = time.monotonic) -> None:
        self.sampler = sampler
        self.clock = clock
        self.stale_after = sampler.hang_after
        self._build = (__version__, platform.python_version(), _version("nvidia-ml-py"))

    def describe(self) -> list[Metric]:
        return []  # families depend on the hardware; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        try:
            families = self._families()
        except Exception:  # noqa: BLE001 - a scrape must answer whatever happens
            log.exception("building the exposition failed; serving exporter metrics only")
            families = self._self_metrics([])
        yield from families

    def _families(self) -> list[Metric]:
        snapshot = self.sampler.store.current
        now = self.clock()
        fresh = [s for s in snapshot.samples if now - s.taken_at <= self.stale_after]
        families = self._gpu_families(fresh)
        families += self._self_metrics(snapshot.samples)
        lost = family(GPU_LOST)
        for device in self.sampler.devices:
            lost.add_metric([str(device.index), device.uuid], 1.0 if device.index in snapshot.lost else 0.0)
        up = family(UP)
        up.add_metric([], 1.0 if fresh or not self.sampler.devices else 0.0)
        driver = family(DRIVER_INFO)
        driver.add_metric([self.sampler.driver_version, self.sampler.cuda_driver_version], 1.0)
        build = family(BUILD_INFO)
        build.add_metric(list(self._build), 1.0)
        return [up, driver, build, lost, *families]

    def _gpu_families(self, samples: list[GpuSample]) -> list[Metric]:
        identity = {device.index: device for device in self.sampler.devices}
        simulated = "true" if self.sampler.simulated else "false"
        out = []
        for spec in GPU_METRICS:
            metric = family(spec, GPU_LABELS + spec.labels)
            for sample in samples:
                gpu = [str(sample.index), sample.uuid]
                if spec.name == "nvml_gpu_info":
                    device = identity[sample.index]
                    metric.add_metric(gpu + [device.name, device.pci_bus_id, device.mig_mode, simulated], 1.0)
                for labels, value in sample.values.get(spec.name, {}).items():
                    metric.add_metric(gpu + list(labels), value)
            if metric.samples:
                out.append(metric)
        return out

    def _self_metrics(self, samples: tuple[GpuSample, ...] | list[GpuSample]) -> list[Metric]:
        now = self.clock()
        success, duration = family(COLLECTOR_SUCCESS), family(COLLECTOR_DURATION)
        for name in self.sampler.collectors:
            runs = [s.runs[name] for s in samples if name in s.runs]
            if runs:
                success.add_metric([name], float(all(run.success for run in runs)))
                duration.add_metric([name], sum(run.duration for run in runs))
        errors = family(ERRORS)
        for (collector, error), count in sorted(self.sampler.stats.errors().items()):
            errors.add_metric([collector, error], count)
        lost_total = family(GPU_LOST_TOTAL)
        for device in self.sampler.devices:
            lost_total.add_metric([str(device.index), device.uuid],
                                  self.sampler.stats.losses().get((str(device.index), device.uuid), 0))
        age, gpu_age = family(SNAPSHOT_AGE), family(GPU_SAMPLE_AGE)
        ages = [max(0.0, now - s.taken_at) for s in samples]
        for sample, sample_age in zip(samples, ages):
            gpu_age.add_metric([str(sample.index), sample.uuid], sample_age)
        if ages:
            age.add_metric([], max(ages))
        calls = family(NVML_CALLS)
        calls.add_metric([], self.sampler.nvml_calls())
        return [success, duration, errors, lost_total, age, gpu_age, calls]
