"""GPU and memory-controller utilization, and busy/idle seconds integrated between scrapes.

nvidia-smi: utilization.gpu, utilization.memory. NVML: nvmlDeviceGetUtilizationRates, and
nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES) — the driver's own sample buffer (about six
samples a second), read from the last seen timestamp so no busy period between two samples is lost.
Without the buffer (older drivers, some MIG setups) the polled rate is integrated instead.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import Absent, CallFailed, union_number


class UtilizationCollector(Collector):
    name = "utilization"
    help = "utilization ratios and busy/idle seconds (driver sample buffer)"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.busy = 0.0
        self.idle = 0.0
        self.last_timestamp: int | None = None  # NVML microseconds of the newest sample seen
        self.last_poll: float | None = None
        self.integrating = False

    def collect(self, ctx: SampleContext) -> None:
        rates = ctx.call("nvmlDeviceGetUtilizationRates")
        if rates is not None:
            ctx.emit("nvml_gpu_utilization_ratio", rates.gpu / 100)
            ctx.emit("nvml_gpu_memory_controller_utilization_ratio", rates.memory / 100)
        try:
            self._integrate_buffer(ctx)
        except Absent:
            self._integrate_poll(ctx, rates)
        except CallFailed as exc:
            ctx.errors.append(exc.error)  # the samples stay in the buffer; read next time
        if self.integrating:
            ctx.emit("nvml_gpu_busy_seconds_total", self.busy)
            ctx.emit("nvml_gpu_idle_seconds_total", self.idle)

    def _add(self, utilization: float, seconds: float) -> None:
        if 0 < seconds <= self.max_gap:
            utilization = min(max(utilization, 0.0), 1.0)
            self.busy += utilization * seconds
            if utilization < self.idle_threshold:
                self.idle += seconds

    def _integrate_buffer(self, ctx: SampleContext) -> None:
        lib = self.device.nvml.lib
        try:
            kind, samples = self.device.call("nvmlDeviceGetSamples", lib.NVML_GPU_UTILIZATION_SAMPLES,
                                             self.last_timestamp or 0)
        except CallFailed as exc:
            if exc.error != "not_found":  # NOT_FOUND: no sample newer than the timestamp yet
                raise
            samples = []
        previous = self.last_timestamp
        for sample in sorted(samples, key=lambda s: s.timeStamp):
            if previous is not None and sample.timeStamp > previous:
                self._add(union_number(self.device.nvml.union_members, kind, sample.sampleValue) / 100,
                          (sample.timeStamp - previous) / 1e6)
            previous = max(previous or 0, sample.timeStamp)
        self.last_timestamp = previous
        self.integrating = True

    def _integrate_poll(self, ctx: SampleContext, rates) -> None:
        if rates is None:
            return
        if self.last_poll is not None:
            self._add(rates.gpu / 100, ctx.now - self.last_poll)
        self.last_poll = ctx.now
        self.integrating = True
