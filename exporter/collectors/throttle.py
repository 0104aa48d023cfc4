"""Clocks-event (throttle) reasons: active flags and seconds active.

nvidia-smi: clocks_event_reasons.* (formerly clocks_throttle_reasons.*). NVML:
nvmlDeviceGetCurrentClocksEventReasons (R535+), else nvmlDeviceGetCurrentClocksThrottleReasons.
Seconds are integrated sample to sample: each sample's reasons count for the time since the
previous sample, so a 30 s scrape still sees a 3 s power-cap episode.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext

REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
ANY_REASON = sum(REASONS.values())


class ThrottleCollector(Collector):
    name = "throttle"
    help = "clocks-event (throttle) reasons"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.seconds = dict.fromkeys(REASONS, 0.0)
        self.last: float | None = None
        # The series as last emitted, handed back unchanged while they are: the mask changes rarely, and
        # the seconds only while a reason is active.
        self.mask: int | None = None
        self.active: dict[tuple[str, ...], float] = {}
        self.totals: dict[tuple[str, ...], float] = {}

    def collect(self, ctx: SampleContext) -> None:
        mask = ctx.call_first(("nvmlDeviceGetCurrentClocksEventReasons",
                               "nvmlDeviceGetCurrentClocksThrottleReasons"))
        if mask is None:
            return
        elapsed = 0.0 if self.last is None else ctx.now - self.last
        self.last = ctx.now
        if mask != self.mask:
            self.mask = mask
            self.active = {(reason,): float(bool(mask & bit)) for reason, bit in REASONS.items()}
        if (mask & ANY_REASON and 0 < elapsed <= self.max_gap) or not self.totals:
            for reason, bit in REASONS.items():
                if mask & bit and 0 < elapsed <= self.max_gap:
                    self.seconds[reason] += elapsed
            self.totals = {(reason,): seconds for reason, seconds in self.seconds.items()}
        ctx.emit_series("nvml_gpu_throttle_active", self.active)
        ctx.emit_series("nvml_gpu_throttle_seconds_total", self.totals)
