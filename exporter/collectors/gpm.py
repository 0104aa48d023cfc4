"""Hopper+ GPU Performance Monitoring: SM, tensor and DRAM activity without DCGM or root.

No nvidia-smi field (dcgmi: DCGM_FI_PROF_SM_ACTIVE, PIPE_TENSOR_ACTIVE, DRAM_ACTIVE). NVML:
nvmlGpmQueryDeviceSupport once, then per run nvmlGpmSampleGet into alternating buffers and
nvmlGpmMetricsGet over the last two samples (metrics SM_UTIL, ANY_TENSOR_UTIL, DRAM_BW_UTIL).
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import Absent, CallFailed, GpuLost


class GpmCollector(Collector):
    name = "gpm"
    period = 5
    help = "SM/tensor/DRAM activity via NVML GPM (Hopper and newer)"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        self.metrics = {"nvml_gpu_sm_active_ratio": lib.NVML_GPM_METRIC_SM_UTIL,
                        "nvml_gpu_tensor_active_ratio": lib.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
                        "nvml_gpu_dram_active_ratio": lib.NVML_GPM_METRIC_DRAM_BW_UTIL}
        self.supported: bool | None = None
        self.samples: list = []
        self.have_previous = False

    def collect(self, ctx: SampleContext) -> None:
        lib = self.device.nvml.lib
        if self.supported is None:
            support = ctx.call("nvmlGpmQueryDeviceSupport")
            if support is None:  # failed: asked again next run (absent: remembered by the device, no call)
                return
            self.supported = bool(support.isSupportedDevice)
            if self.supported:
                self.samples = [ctx.guarded(lambda: self.device.nvml.call("nvmlGpmSampleAlloc")) for _ in range(2)]
                self.supported = None not in self.samples
        if not self.supported:
            return
        previous, current = self.samples
        if ctx.call("nvmlGpmSampleGet", current) is None:
            self.have_previous = False
            return
        self.samples.reverse()
        if not self.have_previous:
            self.have_previous = True
            return
        request = lib.c_nvmlGpmMetricsGet_t()
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self.metrics)
        request.sample1, request.sample2 = previous, current
        for slot, metric_id in enumerate(self.metrics.values()):
            request.metrics[slot].metricId = metric_id
        if ctx.guarded(lambda: self.device.nvml.call("nvmlGpmMetricsGet", request)) is None:
            return
        for slot, metric in enumerate(self.metrics):
            result = request.metrics[slot]
            if result.nvmlReturn == lib.NVML_SUCCESS:
                ctx.emit(metric, result.value / 100)

    def close(self) -> None:
        for sample in self.samples:
            if sample is not None:
                try:
                    self.device.nvml.call("nvmlGpmSampleFree", sample)
                except (Absent, CallFailed, GpuLost):
                    pass
        self.samples = []
        self.supported = None
