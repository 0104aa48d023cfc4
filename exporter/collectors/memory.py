"""Device memory. nvidia-smi: memory.used, memory.total, memory.free.

NVML: nvmlDeviceGetMemoryInfo_v2 (used excludes driver-reserved memory, as nvidia-smi shows it),
falling back to the v1 call on drivers older than R510. Every `period` (5 s): memory moves with
allocations, and the alerts on it look at minutes.

On a GPU in MIG mode the parent handle's memory needs privilege (nvml.h: "appropriate privileges";
the driver checks CAP_SYS_ADMIN), which no shipped deployment grants: NO_PERMISSION there is no error,
and the GPU's memory is the sum of its GPU instances' (read on their MIG devices, which need none).
Memory outside every GPU instance is then not counted.
"""
from __future__ import annotations

from typing import Any

from exporter.collectors.base import Collector, SampleContext
from exporter.collectors.mig import instance_memory
from exporter.nvml import Absent, CallFailed


class MemoryCollector(Collector):
    name = "memory"
    period = 5
    help = "device memory used/free/total"

    def collect(self, ctx: SampleContext) -> None:
        lib = self.device.nvml.lib
        try:
            memory = self._read(lib)
        except CallFailed as exc:
            if exc.error != "no_permission" or self.device.mig_mode != "enabled":
                ctx.errors.append(exc.error)
                return
            instances = [memory for _, memory in instance_memory(ctx, self.device)]
            if not instances:
                return
            used, total, free = (sum(getattr(m, name) for m in instances) for name in ("used", "total", "free"))
        except Absent:
            return
        else:
            used, total, free = memory.used, memory.total, memory.free
        ctx.emit("nvml_gpu_memory_used_bytes", used)
        ctx.emit("nvml_gpu_memory_total_bytes", total)
        ctx.emit("nvml_gpu_memory_free_bytes", free)

    def _read(self, lib: Any) -> Any:
        """The parent handle's memory: v2, else v1 where the driver lacks v2; raises Absent or CallFailed."""
        try:
            return self.device.call("nvmlDeviceGetMemoryInfo", lib.nvmlMemory_v2)
        except Absent:  # remembered: v2 is not asked again
            return self.device.call("nvmlDeviceGetMemoryInfo")
