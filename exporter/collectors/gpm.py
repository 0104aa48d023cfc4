"""Hopper+ GPU Performance Monitoring: SM, tensor and DRAM activity without DCGM or root.

No nvidia-smi field (dcgmi: DCGM_FI_PROF_SM_ACTIVE, PIPE_TENSOR_ACTIVE, DRAM_ACTIVE). NVML:
nvmlGpmQueryDeviceSupport once, then per run nvmlGpmSampleGet into alternating buffers and
nvmlGpmMetricsGet over the last two samples (metrics SM_UTIL, ANY_TENSOR_UTIL, DRAM_BW_UTIL).
A GPU in MIG mode answers for its GPU instances only (nvmlGpmMigSampleGet, in the mig collector).
Two GPM samples less than 100 ms apart give no metrics: a window shorter than MIN_WINDOW is not sampled.
A metric the driver answers NaN for is absent. After a GPU loss (or reset) the window starts again:
the GPU's counters did, so a window over the loss would be garbage.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import Absent, CallFailed, Device

#: metric name suffix -> NVML_GPM_METRIC_* constant name
#: seconds: the shortest window sampled: NVML computes no metrics over two GPM samples less than
#: 100 ms apart, and `ctx.now` is when the sample started, not when its GPM call ran (up to a few
#: collectors later), hence the margin
MIN_WINDOW = 0.2

GPM_METRICS = {"sm_active_ratio": "NVML_GPM_METRIC_SM_UTIL", "tensor_active_ratio": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
               "dram_active_ratio": "NVML_GPM_METRIC_DRAM_BW_UTIL"}


def gpm_supported(ctx: SampleContext, device: Device) -> bool | None:
    """Whether the GPU supports GPM; None when the query failed (ask again next run)."""
    support = ctx.call("nvmlGpmQueryDeviceSupport")
    return None if support is None else bool(support.isSupportedDevice)


class GpmWindow:
    """Two GPM sample buffers filled in turn by `take(buffer)`; `metrics` ({suffix: NVML_GPM_METRIC_* name}) over
    the last two samples, each NVML value times `scale` (percentages to ratios by default)."""

    def __init__(self, device: Device, take: Callable[[Any], Any], metrics: dict[str, str] = GPM_METRICS,
                 scale: float = 0.01) -> None:
        self.device = device
        self.take = take
        self.metrics = metrics
        self.scale = scale
        self.buffers: list = []
        self.have_previous = False
        self.taken_at = 0.0  # ctx.now of the previous sample
        self.ratios: dict[str, float] = {}  # of the last complete window

    def read(self, ctx: SampleContext) -> dict[str, float]:
        """{suffix: ratio} of the window ending now; {} on the first sample or a failed one. A window
        still shorter than MIN_WINDOW is left open: the last window's ratios stand meanwhile."""
        nvml, lib = self.device.nvml, self.device.nvml.lib
        if not self.buffers:
            buffers = [ctx.guarded(lambda: nvml.call("nvmlGpmSampleAlloc")) for _ in range(2)]
            if None in buffers:
                self._free(buffers)
                return {}
            self.buffers = buffers
        if self.have_previous and ctx.now - self.taken_at < MIN_WINDOW:
            return self.ratios
        previous, current = self.buffers
        self.taken_at = ctx.now
        if ctx.guarded(lambda: self.take(current)) is None:
            self.have_previous, self.ratios = False, {}
            return {}
        self.buffers.reverse()
        if not self.have_previous:
            self.have_previous = True
            return {}
        request = lib.c_nvmlGpmMetricsGet_t()
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self.metrics)
        request.sample1, request.sample2 = previous, current
        for slot, constant in enumerate(self.metrics.values()):
            request.metrics[slot].metricId = getattr(lib, constant)
        if ctx.guarded(lambda: nvml.call("nvmlGpmMetricsGet", request)) is None:
            self.ratios = {}
        else:
            self.ratios = {suffix: request.metrics[slot].value * self.scale for slot, suffix in enumerate(self.metrics)
                           if request.metrics[slot].nvmlReturn == lib.NVML_SUCCESS
                           and not math.isnan(request.metrics[slot].value)}
        return self.ratios

    def restart(self) -> None:
        """Drop the previous sample (the buffers stay): the next window starts with the next sample."""
        self.have_previous, self.ratios = False, {}

    def close(self) -> None:
        self._free(self.buffers)
        self.buffers = []
        self.restart()

    def _free(self, buffers: list) -> None:
        for buffer in buffers:
            if buffer is not None:
                try:
                    self.device.nvml.call("nvmlGpmSampleFree", buffer)
                except (Absent, CallFailed):  # Nvml.call never answers GpuLost
                    pass


class GpmCollector(Collector):
    name = "gpm"
    period = 5
    help = "SM/tensor/DRAM activity via NVML GPM (Hopper and newer)"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.supported: bool | None = None
        self.window = GpmWindow(device, lambda buffer: device.call("nvmlGpmSampleGet", buffer))

    def collect(self, ctx: SampleContext) -> None:
        if self.supported is None:
            self.supported = gpm_supported(ctx, self.device)
        if not self.supported or self.device.lacks("nvmlGpmSampleGet"):
            return
        for suffix, ratio in self.window.read(ctx).items():
            ctx.emit(f"nvml_gpu_{suffix}", ratio)

    def restart(self) -> None:
        self.window.restart()

    def close(self) -> None:
        self.window.close()
