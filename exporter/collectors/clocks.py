"""Current and maximum clocks. nvidia-smi: clocks.gr, clocks.sm, clocks.mem, clocks.video, clocks.max.*.

NVML: nvmlDeviceGetClockInfo per clock domain (every `period` (10 s): four calls, and what
makes the clocks drop is told every sample by the throttle reasons), nvmlDeviceGetMaxClockInfo once
(static).
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext

MHZ = 1e6


class ClocksCollector(Collector):
    name = "clocks"
    period = 10
    help = "current and maximum clocks"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        self.domains = {"graphics": lib.NVML_CLOCK_GRAPHICS, "sm": lib.NVML_CLOCK_SM,
                        "memory": lib.NVML_CLOCK_MEM, "video": lib.NVML_CLOCK_VIDEO}
        # read once per clock; a failed read is retried (an absent one is remembered by the device: no call)
        self.max_mhz: dict[str, float] = {}

    def collect(self, ctx: SampleContext) -> None:
        for clock, domain in self.domains.items():
            current = ctx.call("nvmlDeviceGetClockInfo", domain)
            ctx.emit("nvml_gpu_clock_hertz", None if current is None else current * MHZ, clock)
            maximum = self.max_mhz.get(clock)
            if maximum is None:
                maximum = ctx.call("nvmlDeviceGetMaxClockInfo", domain)
                if maximum is not None:
                    self.max_mhz[clock] = maximum
            ctx.emit("nvml_gpu_clock_max_hertz", None if maximum is None else maximum * MHZ, clock)
