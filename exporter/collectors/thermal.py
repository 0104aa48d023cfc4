"""Temperatures and fans.

nvidia-smi: temperature.gpu, temperature.memory, fan.speed. NVML: nvmlDeviceGetTemperature(GPU),
field NVML_FI_DEV_MEMORY_TEMP, nvmlDeviceGetNumFans (once) and nvmlDeviceGetFanSpeed_v2 per fan.
Passively cooled GPUs (SXM boards) have no fans: no fan series, no error.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext


class ThermalCollector(Collector):
    name = "thermal"
    help = "GPU and memory temperature"

    def fields(self):
        return ((self.device.nvml.lib.NVML_FI_DEV_MEMORY_TEMP, 0),)

    def collect(self, ctx: SampleContext) -> None:
        lib = self.device.nvml.lib
        ctx.emit("nvml_gpu_temperature_celsius", ctx.call("nvmlDeviceGetTemperature", lib.NVML_TEMPERATURE_GPU))
        ctx.emit("nvml_gpu_memory_temperature_celsius", ctx.field(lib.NVML_FI_DEV_MEMORY_TEMP))


class FanCollector(Collector):
    name = "fan"
    period = 5
    help = "fan speed ratios"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.fans: int | None = None  # read once; a failed read is retried (an absent one costs no call)

    def collect(self, ctx: SampleContext) -> None:
        if self.fans is None:
            self.fans = ctx.call("nvmlDeviceGetNumFans")
        for fan in range(self.fans or 0):
            speed = ctx.call("nvmlDeviceGetFanSpeed_v2", fan)
            ctx.emit("nvml_gpu_fan_speed_ratio", None if speed is None else speed / 100, str(fan))
