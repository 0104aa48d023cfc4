"""Power draw, power limit, energy counter and performance state.

nvidia-smi: power.draw.instant, power.limit, (no energy field; `nvidia-smi -q -d POWER`), pstate.
NVML fields NVML_FI_DEV_POWER_INSTANT, NVML_FI_DEV_POWER_CURRENT_LIMIT (mW) and
NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ), all in the shared field batch; drivers without those
fields fall back to nvmlDeviceGetPowerUsage / GetEnforcedPowerLimit / GetTotalEnergyConsumption.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext


class PowerCollector(Collector):
    name = "power"
    help = "power draw, power limit and energy counter"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        self.readings = (
            ("nvml_gpu_power_usage_watts", lib.NVML_FI_DEV_POWER_INSTANT, "nvmlDeviceGetPowerUsage"),
            ("nvml_gpu_power_limit_watts", lib.NVML_FI_DEV_POWER_CURRENT_LIMIT, "nvmlDeviceGetEnforcedPowerLimit"),
            ("nvml_gpu_energy_joules_total", lib.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
             "nvmlDeviceGetTotalEnergyConsumption"))

    def fields(self):
        return ((field_id, 0) for _, field_id, _ in self.readings)

    def collect(self, ctx: SampleContext) -> None:
        for metric, field_id, fallback in self.readings:
            milli = ctx.field(field_id)
            if milli is None and self.device.lacks_field(field_id):
                milli = ctx.call(fallback)
            ctx.emit(metric, None if milli is None else milli / 1000)


class PerformanceStateCollector(Collector):
    name = "pstate"
    period = 10
    help = "performance state (P0-P15)"

    def collect(self, ctx: SampleContext) -> None:
        state = ctx.call("nvmlDeviceGetPerformanceState")
        # 32 is NVML_PSTATE_UNKNOWN: no sample rather than a misleading number.
        ctx.emit("nvml_gpu_performance_state", state if state is not None and state < 16 else None)
