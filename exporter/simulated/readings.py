"""What the simulated GPUs read, one NVML call a value: utilization (rates and the driver's sample
buffer), memory, temperatures, fans, power and energy, clocks and their throttle reasons, PCIe
throughput. Like a driver: no utilization samples while the GPU idles (NOT_FOUND), none from the
future, their spacing jittered; NOT_SUPPORTED for what a board lacks or MIG mode hides."""
from __future__ import annotations

import math
from typing import Any

import pynvml

from exporter.simulated.driver import JITTER, Driver, nvml_function
from exporter.simulated.nvml_h import H
from exporter.simulated.workload import (
    MIB,
    MIG_INSTANCES,
    PCIE_RX_BUSY_RATE,
    PCIE_RX_RATE,
    PCIE_TX_RATE,
    THROTTLED_SM_MHZ,
)

BUFFER = 120  # utilization samples the driver keeps
# nvidia-smi -q -d TEMPERATURE of an H100 SXM: shutdown, slowdown, GPU and memory max operating
_H100_THRESHOLDS = {H.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: 92, H.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 89,
                    H.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: 87, H.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: 95}


class Readings(Driver):
    """NVML's per-device reading functions."""

    @nvml_function
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle)
        if self.traits[gpu].mig:
            raise pynvml.NVMLError_NotSupported()
        busy = self.workload.utilization(gpu, self._t())
        return pynvml.c_nvmlUtilization_t(gpu=round(100 * busy), memory=round(45 * busy))

    @nvml_function
    def nvmlDeviceGetSamples(self, handle: Any, sampling_type: int, timestamp: int) -> tuple[int, list[Any]]:
        gpu = self._gpu(handle)
        if self.traits[gpu].mig or sampling_type != H.NVML_GPU_UTILIZATION_SAMPLES:
            raise pynvml.NVMLError_NotSupported()
        period = self.traits[gpu].sample_period
        now, now_tick = int(self.clock() * 1e6), math.floor(self._t() / period)
        first = max(now_tick - BUFFER + 1, 1)
        if timestamp:  # entries up to `timestamp` (each up to JITTER/2 periods off its slot) were read before
            first = max(first, math.floor((timestamp / 1e6 - self.start) / period - JITTER))
        samples = []
        for tick in range(first, now_tick + 2):
            stamp = self._sample_stamp(gpu, tick, period)
            busy = self.workload.utilization(gpu, (tick - 0.5) * period)
            # like the driver: no samples while the GPU idles, none from the future
            if timestamp < stamp <= now and busy > 0:
                sample = pynvml.c_nvmlSample_t(timeStamp=stamp)
                sample.sampleValue.uiVal = round(100 * busy)
                samples.append(sample)
        if not samples:
            raise pynvml.NVMLError_NotFound()
        return H.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    @nvml_function
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._gpu(handle)
        self._check_privilege(gpu, handle)
        total, used, reserved = self.traits[gpu].memory_total, self.workload.memory_used(gpu, self._t()), 512 * MIB
        if self._mig_of(handle) is not None:  # an equal share of the GPU per GPU instance
            total, used, reserved = total // MIG_INSTANCES, used // MIG_INSTANCES, reserved // MIG_INSTANCES
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, used=used + reserved, free=total - used - reserved)
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved, used=used,
                                        free=total - used - reserved)

    # --- thermal ----------------------------------------------------------------------------------
    def _temperature(self, handle: Any, sensor: int) -> int:
        if sensor != H.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError_InvalidArgument()
        gpu, t = self._gpu(handle), self._t()
        if self.workload.faulty(gpu, t) == "thermal-throttle":
            return 88 + gpu
        return round(34 + 36 * self.workload.utilization(gpu, t)) + gpu

    @nvml_function
    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int, version: int = 0x100000C) -> int:
        return self._temperature(handle, sensor)

    @nvml_function
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:  # deprecated for removal in CUDA 14
        return self._temperature(handle, sensor)

    @nvml_function
    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        celsius = _H100_THRESHOLDS.get(threshold)
        if celsius is None:  # the acoustic limits: boards with fans only
            raise pynvml.NVMLError_NotSupported()
        return celsius

    @nvml_function
    def nvmlDeviceGetNumFans(self, handle: Any) -> int:
        fans = self.traits[self._gpu(handle)].fans
        if not fans:
            raise pynvml.NVMLError_NotSupported()
        return fans

    @nvml_function
    def nvmlDeviceGetFanSpeed_v2(self, handle: Any, fan: int) -> int:
        gpu = self._gpu(handle)
        if fan >= self.traits[gpu].fans:
            raise pynvml.NVMLError_InvalidArgument()
        return round(30 + 40 * self.workload.utilization(gpu, self._t()))

    # --- power ------------------------------------------------------------------------------------
    def _power(self, handle: Any) -> int:
        """The GPU of `handle`; NOT_SUPPORTED where it has no power readings."""
        gpu = self._gpu(handle)
        if not self.traits[gpu].power:
            raise pynvml.NVMLError_NotSupported()
        return gpu

    @nvml_function
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self.workload.power_mw(self._power(handle), self._t())

    @nvml_function
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        self._power(handle)
        return 700_000

    @nvml_function
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self.workload.energy_mj(self._power(handle), self._t())

    @nvml_function
    def nvmlDeviceGetPerformanceState(self, handle: Any) -> int:
        return 0

    # --- clocks -----------------------------------------------------------------------------------
    @nvml_function
    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        gpu, t = self._gpu(handle), self._t()
        busy = self.workload.utilization(gpu, t) >= 0.05
        top = THROTTLED_SM_MHZ if self.workload.faulty(gpu, t) == "thermal-throttle" else 1980
        return {H.NVML_CLOCK_GRAPHICS: top if busy else 345, H.NVML_CLOCK_SM: top if busy else 345,
                H.NVML_CLOCK_MEM: 2619, H.NVML_CLOCK_VIDEO: 1755 if busy else 765}[clock]

    @nvml_function
    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock: int) -> int:
        return {H.NVML_CLOCK_GRAPHICS: 1980, H.NVML_CLOCK_SM: 1980, H.NVML_CLOCK_MEM: 2619,
                H.NVML_CLOCK_VIDEO: 1965}[clock]

    def _reasons(self, handle: Any) -> int:
        gpu, t = self._gpu(handle), self._t()
        idle = self.workload.utilization(gpu, t) < 0.05
        thermal = self.workload.faulty(gpu, t) == "thermal-throttle"
        return ((H.nvmlClocksEventReasonGpuIdle if idle else 0)
                | (H.nvmlClocksEventReasonSwThermalSlowdown if thermal else 0))

    @nvml_function
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._reasons(handle)

    @nvml_function
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:  # the pre-R535 name
        return self._reasons(handle)

    @nvml_function
    def nvmlDeviceGetPcieThroughput(self, handle: Any, counter: int) -> int:
        busy = self.workload.utilization(self._gpu(handle), self._t())
        rate = PCIE_TX_RATE if counter == H.NVML_PCIE_UTIL_TX_BYTES else PCIE_RX_RATE + PCIE_RX_BUSY_RATE * busy
        return int(rate / 1024)
