"""Device memory. nvidia-smi: memory.used, memory.total, memory.free.

NVML: nvmlDeviceGetMemoryInfo_v2 (used excludes driver-reserved memory, as nvidia-smi shows it),
falling back to the v1 call on drivers older than R510. Every `period` (5 s): memory moves with
allocations, and the alerts on it look at minutes.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext


class MemoryCollector(Collector):
    name = "memory"
    period = 5
    help = "device memory used/free/total"

    def collect(self, ctx: SampleContext) -> None:
        lib = self.device.nvml.lib
        memory = ctx.call("nvmlDeviceGetMemoryInfo", lib.nvmlMemory_v2)
        if memory is None and self.device.lacks("nvmlDeviceGetMemoryInfo", lib.nvmlMemory_v2):
            memory = ctx.call("nvmlDeviceGetMemoryInfo")
        if memory is not None:
            ctx.emit("nvml_gpu_memory_used_bytes", memory.used)
            ctx.emit("nvml_gpu_memory_total_bytes", memory.total)
            ctx.emit("nvml_gpu_memory_free_bytes", memory.free)
