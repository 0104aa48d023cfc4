"""GPM (GPU performance monitoring): samples of a GPU's counters, and metrics computed from two of
them, as the driver computes them. Two samples closer than GPM_MIN_WINDOW give INVALID_ARGUMENT; in MIG
mode GPM answers per GPU instance only; a metric can be answered NaN (`DeviceTraits.gpm_nan_metrics`)."""
from __future__ import annotations

import math
from typing import Any

import pynvml

from exporter.simulated.driver import Driver, allocated, nvml_function
from exporter.simulated.nvml_h import H
from exporter.simulated.workload import MIB, MIG_INSTANCES, PCIE_RX_BUSY_RATE, PCIE_RX_RATE, PCIE_TX_RATE

GPM_MIN_WINDOW = 0.1  # seconds: two GPM samples closer than this give no metrics (INVALID_ARGUMENT)
_UTILIZATION = {H.NVML_GPM_METRIC_SM_UTIL: 85.0, H.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 60.0,
                H.NVML_GPM_METRIC_DRAM_BW_UTIL: 45.0}  # percent while fully busy


class Gpm(Driver):
    """NVML's GPM functions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gpm_buffers: set[int] = set()  # addresses of the allocated samples
        self._gpm_samples: dict[int, tuple[int, float, float]] = {}  # address -> (GPU, t, busy counter)

    def _release(self) -> None:
        super()._release()
        self._gpm_buffers.clear()
        self._gpm_samples.clear()

    def _gpm_counter(self, gpu: int, t: float) -> float:
        """The GPU's busy counter at t, as a GPM sample reads it."""
        return self.workload.busy_seconds(gpu, t)

    def _gpm_sample(self, gpu: int, where: int) -> None:
        """Sample the GPU's counters into the sample at `where`."""
        t = self._t()
        self._gpm_samples[where] = (gpu, t, self._gpm_counter(gpu, t))

    @nvml_function
    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = H.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(self.traits[self._gpu(handle)].gpm)
        return support

    @nvml_function
    def nvmlGpmSampleAlloc(self) -> Any:
        where, handle = self._new_handle(pynvml.c_nvmlGpmSample_t, self._keep)
        self._gpm_buffers.add(where)
        return handle

    @nvml_function
    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._gpm_buffers.discard(allocated(sample, self._gpm_buffers))

    @nvml_function
    def nvmlGpmMigSampleGet(self, handle: Any, gpu_instance_id: int, sample: Any) -> Any:
        where, gpu = allocated(sample, self._gpm_buffers), self._gpu(handle)
        if not self.traits[gpu].mig or not 1 <= gpu_instance_id <= MIG_INSTANCES:
            raise pynvml.NVMLError_InvalidArgument()
        self._gpm_sample(gpu, where)
        return sample

    @nvml_function
    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> Any:
        where, gpu = allocated(sample, self._gpm_buffers), self._gpu(handle)
        if self.traits[gpu].mig:  # in MIG mode GPM answers per GPU instance only
            raise pynvml.NVMLError_NotSupported()
        self._gpm_sample(gpu, where)
        return sample

    @nvml_function
    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        gpu, first_t, first = self._gpm_samples[allocated(request.sample1, self._gpm_buffers)]
        _, second_t, second = self._gpm_samples[allocated(request.sample2, self._gpm_buffers)]
        if second_t - first_t < GPM_MIN_WINDOW:
            raise pynvml.NVMLError_InvalidArgument()
        # from counters, as the driver does: across a restart of the counters the difference is garbage
        busy = (second - first) / (second_t - first_t)
        pcie = {H.NVML_GPM_METRIC_PCIE_TX_PER_SEC: PCIE_TX_RATE / MIB,  # MiB/s
                H.NVML_GPM_METRIC_PCIE_RX_PER_SEC: (PCIE_RX_RATE + PCIE_RX_BUSY_RATE * busy) / MIB}
        nan = self.traits[gpu].gpm_nan_metrics
        for slot in range(request.numMetrics):
            metric = request.metrics[slot]
            if metric.metricId in nan:
                metric.value, metric.nvmlReturn = math.nan, H.NVML_SUCCESS
            elif metric.metricId in _UTILIZATION:
                metric.value, metric.nvmlReturn = _UTILIZATION[metric.metricId] * busy, H.NVML_SUCCESS
            elif metric.metricId in pcie:
                metric.value, metric.nvmlReturn = pcie[metric.metricId], H.NVML_SUCCESS
            else:
                metric.nvmlReturn = H.NVML_ERROR_NOT_SUPPORTED
        return request
