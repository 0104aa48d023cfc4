"""GPU and memory-controller utilization, and busy/idle seconds integrated between scrapes.

nvidia-smi: utilization.gpu, utilization.memory. NVML: nvmlDeviceGetUtilizationRates, and
nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES) — the driver's own sample buffer (about six
samples a second), read from the last seen timestamp so no busy period between two samples is lost.
Each sample counts for its own sampling period; time the buffer does not cover (it runs dry while
the GPU idles) counts as idle. Without the buffer (older drivers, some MIG setups) the polled rate
is integrated instead.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import Absent, CallFailed, union_value


class UtilizationCollector(Collector):
    name = "utilization"
    help = "utilization ratios and busy/idle seconds (driver sample buffer)"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.busy = 0.0
        self.idle = 0.0
        self.last_timestamp: int | None = None  # NVML microseconds of the newest sample seen
        self.sample_period: float | None = None  # the driver's sampling period: the shortest spacing seen, seconds
        self.last_poll: float | None = None
        self.integrating = False

    def collect(self, ctx: SampleContext) -> None:
        rates = ctx.call("nvmlDeviceGetUtilizationRates")
        if rates is not None:
            ctx.emit("nvml_gpu_utilization_ratio", _ratio(rates.gpu))
            ctx.emit("nvml_gpu_memory_controller_utilization_ratio", _ratio(rates.memory))
        elapsed = None if self.last_poll is None else ctx.now - self.last_poll
        try:
            self._integrate_buffer(ctx, elapsed)
        except Absent:
            self._integrate_poll(rates, elapsed)
        except CallFailed as exc:
            ctx.errors.append(exc.error)  # the samples stay in the buffer; read next time
        self.last_poll = ctx.now
        if self.integrating:
            ctx.emit("nvml_gpu_busy_seconds_total", self.busy)
            ctx.emit("nvml_gpu_idle_seconds_total", self.idle)

    def _add(self, utilization: float, seconds: float) -> None:
        self.busy += utilization * seconds
        if utilization < self.idle_threshold:
            self.idle += seconds

    def _integrate_buffer(self, ctx: SampleContext, elapsed: float | None) -> None:
        """Credit each new sample for its own sampling period; time no sample covers is idle.

        The driver stops filling its buffer while the GPU is idle (nvmlDeviceGetSamples answers
        NOT_FOUND, or SUCCESS with no samples): the part of the time since the last poll that no
        sample covers is idle time. A poll gap longer than `max_gap` (a hang) is credited to nothing
        beyond the samples the buffer kept.
        """
        lib = self.device.nvml.lib
        try:
            kind, samples = self.device.call("nvmlDeviceGetSamples", lib.NVML_GPU_UTILIZATION_SAMPLES,
                                             self.last_timestamp or 0)
        except CallFailed as exc:
            if exc.error != "not_found":  # NOT_FOUND: no sample newer than the timestamp (dry buffer)
                raise
            samples = []
        self.integrating = True
        previous = self.last_timestamp
        covered = 0.0
        for sample in sorted(samples, key=lambda s: s.timeStamp):
            if previous is not None and sample.timeStamp > previous:
                spacing = (sample.timeStamp - previous) / 1e6
                self.sample_period = spacing if self.sample_period is None else min(self.sample_period, spacing)
                value = union_value(self.device.nvml.value_types, kind, sample.sampleValue).value
                self._add(_ratio(value), self.sample_period)
                covered += self.sample_period
            previous = max(previous or 0, sample.timeStamp)
        self.last_timestamp = previous
        uncovered = 0.0 if elapsed is None or not 0 < elapsed <= self.max_gap else elapsed - covered
        if uncovered > (self.sample_period or 0.0) / 2:  # not clock jitter between sampler and driver
            self.idle += uncovered

    def _integrate_poll(self, rates, elapsed: float | None) -> None:
        if rates is None:
            return
        if elapsed is not None and 0 < elapsed <= self.max_gap:
            self._add(_ratio(rates.gpu), elapsed)
        self.integrating = True


def _ratio(percent: float) -> float:
    """A utilization percentage as a ratio clamped to [0, 1] (drivers have returned garbage above 100)."""
    return min(max(percent / 100, 0.0), 1.0)
