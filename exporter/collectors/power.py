"""Power draw, power limit, energy counter and performance state.

nvidia-smi: power.draw (a 1 s average), power.draw.instant, power.limit, (no energy field; `nvidia-smi -q -d
POWER`), pstate. NVML fields NVML_FI_DEV_POWER_INSTANT, NVML_FI_DEV_POWER_CURRENT_LIMIT (mW) and
NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ), all in the shared field batch; drivers without those
fields fall back to nvmlDeviceGetPowerUsage / GetEnforcedPowerLimit / GetTotalEnergyConsumption.

The power draw (nvml_gpu_power_usage_watts) is the mean over the sample period: the energy counter's
increase divided by the time between two readings, as nvidia-smi's power.draw and dcgm-exporter report an
average rather than one instant. The instantaneous reading is nvml_gpu_power_instant_watts. Without an
energy counter, on the first sample, after a gap longer than `max_gap` or a counter reset, the draw is the
instantaneous reading.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext


class PowerCollector(Collector):
    name = "power"
    help = "power draw (mean and instantaneous), power limit and energy counter"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        self.readings = (
            ("nvml_gpu_power_instant_watts", lib.NVML_FI_DEV_POWER_INSTANT, "nvmlDeviceGetPowerUsage"),
            ("nvml_gpu_power_limit_watts", lib.NVML_FI_DEV_POWER_CURRENT_LIMIT, "nvmlDeviceGetEnforcedPowerLimit"),
            ("nvml_gpu_energy_joules_total", lib.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
             "nvmlDeviceGetTotalEnergyConsumption"))
        self.previous: tuple[float, float] | None = None  # (energy in joules, when read)

    def fields(self):
        return ((field_id, 0) for _, field_id, _ in self.readings)

    def collect(self, ctx: SampleContext) -> None:
        read = {}
        for metric, field_id, fallback in self.readings:
            milli = ctx.field(field_id)
            if milli is None and self.device.lacks_field(field_id):
                milli = ctx.call(fallback)
            read[metric] = None if milli is None else milli / 1000
            ctx.emit(metric, read[metric])
        mean = self._mean(read["nvml_gpu_energy_joules_total"], ctx.now)
        ctx.emit("nvml_gpu_power_usage_watts", read["nvml_gpu_power_instant_watts"] if mean is None else mean)

    def _mean(self, joules: float | None, now: float) -> float | None:
        """Watts from the energy counter since the last reading; None without two readings to divide."""
        previous, self.previous = self.previous, None if joules is None else (joules, now)
        if joules is None or previous is None:
            return None
        elapsed = now - previous[1]
        if not 0 < elapsed <= self.max_gap or joules < previous[0]:  # a gap, or the driver reloaded
            return None
        return (joules - previous[0]) / elapsed

    def restart(self) -> None:
        self.previous = None


class PerformanceStateCollector(Collector):
    name = "pstate"
    period = 10
    help = "performance state (P0-P15)"

    def collect(self, ctx: SampleContext) -> None:
        state = ctx.call("nvmlDeviceGetPerformanceState")
        # 32 is NVML_PSTATE_UNKNOWN: no sample rather than a misleading number.
        ctx.emit("nvml_gpu_performance_state", state if state is not None and state < 16 else None)
