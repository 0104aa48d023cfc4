"""Current and maximum clocks. nvidia-smi: clocks.gr, clocks.sm, clocks.mem, clocks.video, clocks.max.*.

NVML: nvmlDeviceGetClockInfo per clock domain (every `period` samples: clocks move with load but a
dashboard does not need them every second), nvmlDeviceGetMaxClockInfo once (static).
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext

MHZ = 1e6


class ClocksCollector(Collector):
    name = "clocks"
    period = 5
    help = "current and maximum clocks"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        self.domains = {"graphics": lib.NVML_CLOCK_GRAPHICS, "sm": lib.NVML_CLOCK_SM,
                        "memory": lib.NVML_CLOCK_MEM, "video": lib.NVML_CLOCK_VIDEO}
        self.max_mhz: dict[str, float | None] | None = None

    def collect(self, ctx: SampleContext) -> None:
        if self.max_mhz is None:
            self.max_mhz = {clock: ctx.call("nvmlDeviceGetMaxClockInfo", domain)
                            for clock, domain in self.domains.items()}
        for clock, domain in self.domains.items():
            current = ctx.call("nvmlDeviceGetClockInfo", domain)
            ctx.emit("nvml_gpu_clock_hertz", None if current is None else current * MHZ, clock)
            maximum = self.max_mhz[clock]
            ctx.emit("nvml_gpu_clock_max_hertz", None if maximum is None else maximum * MHZ, clock)
