"""GPU and memory-controller utilization, and busy/idle seconds integrated between scrapes.

nvidia-smi: utilization.gpu, utilization.memory. NVML: nvmlDeviceGetUtilizationRates, and
nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES) — the driver's own sample buffer (one sample every
1/6 s to 1 s depending on the product, about 15 s kept), read from the last seen timestamp so no busy
period between two samples is lost. Each sample counts for its own period, the spacing from the
sample before it: the driver's spacing jitters, so no single spacing stands for all. A spacing longer
than JITTER_BOUND typical periods (the median of recent spacings) is a gap in the buffer (it runs dry
while the GPU idles): that sample counts for one typical period, and the rest of the gap is time no
sample covers, which counts as idle. The first poll only learns where the buffer ends: its ~15 s
are from before the exporter started. Without the buffer (older drivers, some MIG setups) the polled
rate is integrated instead.

Cadence: with the buffer, the GPU ratio is the newest buffer sample's (the driver's latest sample
period, what nvmlDeviceGetUtilizationRates answers too), so nvmlDeviceGetUtilizationRates is called
only every RATES_PERIOD seconds, for the memory-controller ratio, and on a poll that finds no new
buffer sample (an idle GPU, a product sampling once a second). Without the buffer it is called on
every sample.
"""
from __future__ import annotations

from collections import deque
from operator import itemgetter

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import Absent, CallFailed, read_field, union_layout

SPACINGS = 64  # recent sample spacings the typical sampling period is the median of
MAX_PERIOD = 2.0  # seconds: twice the longest sampling period of any product (1 s, NVML): a longer spacing is a gap
DEFAULT_PERIOD = 1 / 6  # seconds: the period of most products, until spacings are seen
JITTER_BOUND = 1.5  # a spacing up to this many typical periods is the sample's own period
LAG_PERIODS = 2  # poll time not yet covered by samples, in typical periods, that is lag rather than idle
RATES_PERIOD = 10.0  # seconds between two nvmlDeviceGetUtilizationRates calls while the buffer answers


class UtilizationCollector(Collector):
    name = "utilization"
    help = "utilization ratios and busy/idle seconds (driver sample buffer)"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.busy = 0.0
        self.idle = 0.0
        self.last_timestamp: int | None = None  # NVML microseconds of the newest sample seen
        self.spacings: deque[float] = deque(maxlen=SPACINGS)  # recent spacings of at most MAX_PERIOD, seconds
        self.uncovered = 0.0  # poll time since the newest sample: lag up to LAG_PERIODS, then idle
        self.last_poll: float | None = None
        self.integrating = False
        self.rates_at: float | None = None  # when nvmlDeviceGetUtilizationRates was last called
        self.memory_ratio: float | None = None  # of the last nvmlDeviceGetUtilizationRates answer

    def collect(self, ctx: SampleContext) -> None:
        elapsed = None if self.last_poll is None else ctx.now - self.last_poll
        newest: float | None = None  # the newest new buffer sample's ratio
        buffered = True
        try:
            newest = self._integrate_buffer(ctx, elapsed)
        except Absent:
            buffered = False
        except CallFailed as exc:
            ctx.errors.append(exc.error)  # the samples stay in the buffer; read next time
        rates = None
        if not buffered or newest is None or self.rates_at is None or ctx.now - self.rates_at >= RATES_PERIOD:
            self.rates_at = ctx.now
            rates = ctx.call("nvmlDeviceGetUtilizationRates")
            self.memory_ratio = None if rates is None else _ratio(rates.memory)
        if not buffered:
            self._integrate_poll(rates, elapsed)
        if newest is None and rates is not None:
            newest = _ratio(rates.gpu)
        ctx.emit("nvml_gpu_utilization_ratio", newest)
        ctx.emit("nvml_gpu_memory_controller_utilization_ratio", self.memory_ratio)
        self.last_poll = ctx.now
        if self.integrating:
            ctx.emit("nvml_gpu_busy_seconds_total", self.busy)
            ctx.emit("nvml_gpu_idle_seconds_total", self.idle)

    def _add(self, utilization: float, seconds: float) -> None:
        self.busy += utilization * seconds
        if utilization < self.idle_threshold:
            self.idle += seconds

    def _integrate_buffer(self, ctx: SampleContext, elapsed: float | None) -> float | None:
        """Credit each new sample for its own period; poll time no sample covers is idle. Returns the
        newest new sample's ratio, None when there is none.

        The driver stops filling its buffer while the GPU is idle (nvmlDeviceGetSamples answers
        NOT_FOUND, or SUCCESS with no samples). The newest sample always lags the poll by up to a
        period or so, so poll time not covered by samples is idle only beyond LAG_PERIODS typical
        periods. A poll gap longer than `max_gap` (a hang) is credited to nothing beyond the samples
        the buffer kept. On the first poll (`elapsed` None) nothing is credited.
        """
        lib = self.device.nvml.lib
        try:
            kind, samples = self.device.call("nvmlDeviceGetSamples", lib.NVML_GPU_UTILIZATION_SAMPLES,
                                             self.last_timestamp or 0)
        except CallFailed as exc:
            if exc.error != "not_found":  # NOT_FOUND: no sample newer than the timestamp (dry buffer)
                raise
            kind, samples = None, []
        self.integrating = True
        previous = self.last_timestamp
        covered = 0.0
        newest = None
        typical = self._typical()
        layout = union_layout(self.device.nvml.value_types, kind)
        readings = sorted(((read_field(s, "timeStamp"), read_field(s, "sampleValue")) for s in samples),
                          key=itemgetter(0))
        for stamp, value in readings:
            if previous is not None and stamp <= previous:
                continue
            spacing = None if previous is None else (stamp - previous) / 1e6
            if spacing is not None and spacing <= MAX_PERIOD:
                self.spacings.append(spacing)
            previous = stamp
            newest = _ratio(layout.unpack_from(value)[0])
            if elapsed is not None:
                # its own spacing, or one typical period after a gap (or for the first sample ever seen)
                period = spacing if spacing is not None and spacing <= JITTER_BOUND * typical else typical
                self._add(newest, period)
                covered += period
        self.last_timestamp = previous
        if elapsed is not None and 0 < elapsed <= self.max_gap:
            self.uncovered += elapsed
        self.uncovered = max(0.0, self.uncovered - covered)
        lag = LAG_PERIODS * typical
        if self.uncovered > lag:
            self.idle += self.uncovered - lag
            self.uncovered = lag
        return newest

    def _typical(self) -> float:
        """The driver's typical sampling period: the (upper) median of recent spacings, seconds. Sorted
        here rather than with statistics.median, whose import (decimal, fractions) costs 0.4 MB of RSS."""
        return sorted(self.spacings)[len(self.spacings) // 2] if self.spacings else DEFAULT_PERIOD

    def _integrate_poll(self, rates, elapsed: float | None) -> None:
        if rates is None:
            return
        if elapsed is not None and 0 < elapsed <= self.max_gap:
            self._add(_ratio(rates.gpu), elapsed)
        self.integrating = True


def _ratio(percent: float) -> float:
    """A utilization percentage as a ratio clamped to [0, 1] (drivers have returned garbage above 100)."""
    return min(max(percent / 100, 0.0), 1.0)
