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


class ThrottleCollector(Collector):
    name = "throttle"
    help = "clocks-event (throttle) reasons"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.seconds = dict.fromkeys(REASONS, 0.0)
        self.last: float | None = None

    def collect(self, ctx: SampleContext) -> None:
        mask = ctx.call_first(("nvmlDeviceGetCurrentClocksEventReasons",
                               "nvmlDeviceGetCurrentClocksThrottleReasons"))
        if mask is None:
            return
        elapsed = 0.0 if self.last is None else ctx.now - self.last
        self.last = ctx.now
        for reason, bit in REASONS.items():
            active = bool(mask & bit)
            if active and 0 < elapsed <= self.max_gap:
                self.seconds[reason] += elapsed
            ctx.emit("nvml_gpu_throttle_active", int(active), reason)
            ctx.emit("nvml_gpu_throttle_seconds_total", self.seconds[reason], reason)
