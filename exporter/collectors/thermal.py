"""Temperatures, temperature thresholds and fans.

nvidia-smi: temperature.gpu, temperature.memory, `-q -d TEMPERATURE` (thresholds), fan.speed.
Temperatures every `period` (10 s): they change over tens of seconds, and thermal slowdown
itself is the throttle collector's, read every sample.
NVML: nvmlDeviceGetTemperatureV(GPU) where the driver and binding have it (the older
nvmlDeviceGetTemperature is deprecated for removal in CUDA 14) else nvmlDeviceGetTemperature, field
NVML_FI_DEV_MEMORY_TEMP (HBM; a 0 is "not reported", as some boards answer), the thresholds with
nvmlDeviceGetTemperatureThreshold (once each: slowdown, shutdown, GPU and memory maximum operating
temperature, the acoustic limits where the board has them), nvmlDeviceGetNumFans (once) and
nvmlDeviceGetFanSpeed_v2 per fan. Passively cooled GPUs (SXM boards) have no fans: no fan series,
no error.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext

TEMPERATURE_CALLS = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
#: threshold label -> NVML_TEMPERATURE_THRESHOLD_* constant name
THRESHOLDS = {"shutdown": "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", "slowdown": "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN",
              "memory_max": "NVML_TEMPERATURE_THRESHOLD_MEM_MAX", "gpu_max": "NVML_TEMPERATURE_THRESHOLD_GPU_MAX",
              "acoustic_min": "NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_MIN",
              "acoustic_current": "NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_CURR",
              "acoustic_max": "NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_MAX"}


class ThermalCollector(Collector):
    name = "thermal"
    period = 10
    help = "GPU and memory temperature, temperature thresholds"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        self.thresholds = {label: getattr(lib, constant) for label, constant in THRESHOLDS.items()}
        self.threshold_celsius: dict[str, float] = {}  # read once each; a failed read is retried

    def fields(self):
        return ((self.device.nvml.lib.NVML_FI_DEV_MEMORY_TEMP, 0),)

    def collect(self, ctx: SampleContext) -> None:
        lib = self.device.nvml.lib
        ctx.emit("nvml_gpu_temperature_celsius", ctx.call_first(TEMPERATURE_CALLS, lib.NVML_TEMPERATURE_GPU))
        memory = ctx.field(lib.NVML_FI_DEV_MEMORY_TEMP)
        ctx.emit("nvml_gpu_memory_temperature_celsius", memory or None)
        for label, threshold in self.thresholds.items():
            celsius = self.threshold_celsius.get(label)
            if celsius is None:
                celsius = ctx.call("nvmlDeviceGetTemperatureThreshold", threshold)
                if celsius is not None:
                    self.threshold_celsius[label] = celsius
            ctx.emit("nvml_gpu_temperature_threshold_celsius", celsius or None, label)


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
