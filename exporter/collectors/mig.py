"""MIG: each GPU instance of a GPU in MIG mode, labelled `gpu_instance` (the GPU instance id).

nvidia-smi: `nvidia-smi -L` (MIG-… UUIDs), `nvidia-smi mig -lgi`, the MIG device memory table.
NVML: nvmlDeviceGetMaxMigDeviceCount and nvmlDeviceGetMigDeviceHandleByIndex (every run: MIG can be
reconfigured while the exporter runs), nvmlDeviceGetGpuInstanceId and nvmlDeviceGetUUID (MIG-…) per
MIG device, nvmlDeviceGetMemoryInfo and, where the driver answers it for a MIG device,
nvmlDeviceGetUtilizationRates on the MIG device handle; GPM per GPU instance with
nvmlGpmMigSampleGet (Hopper+). A GPU without MIG mode exports none of this.

A MIG device is a compute instance: a GPU instance split into several compute instances has several
MIG devices (each its own MIG-UUID, all in `nvml_gpu_mig_info`), but its memory, utilization and GPM
window are the GPU instance's and are read once per run, from its first MIG device.
"""
from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

from exporter.collectors.base import Collector, SampleContext
from exporter.collectors.gpm import GpmWindow, gpm_supported
from exporter.nvml import Absent, CallFailed, Device, as_text


def mig_devices(ctx: SampleContext, device: Device) -> Iterator[tuple[Any, int]]:
    """(handle, GPU instance id) of each MIG device of a GPU in MIG mode; failed reads are counted."""
    count = ctx.call("nvmlDeviceGetMaxMigDeviceCount")
    for index in range(count or 0):
        try:
            handle = device.call("nvmlDeviceGetMigDeviceHandleByIndex", index)
        except Absent:  # the driver does not support this slot: nothing there
            continue
        except CallFailed as exc:
            if exc.error != "not_found":  # NOT_FOUND: no MIG device in this slot
                ctx.errors.append(exc.error)
            continue
        instance = ctx.guarded(partial(device.call_on, handle, "nvmlDeviceGetGpuInstanceId"))
        if instance is not None:
            yield handle, instance


def instance_memory(ctx: SampleContext, device: Device) -> list[tuple[int, Any]]:
    """(GPU instance id, nvmlDeviceGetMemoryInfo) of each GPU instance, read from its first MIG device."""
    found: dict[int, Any] = {}
    for handle, instance in mig_devices(ctx, device):
        if instance not in found:
            found[instance] = ctx.guarded(partial(device.call_on, handle, "nvmlDeviceGetMemoryInfo"))
    return [(instance, memory) for instance, memory in found.items() if memory is not None]


class MigCollector(Collector):
    name = "mig"
    period = 5
    help = "per MIG GPU instance: identity, memory, utilization and GPM activity"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.gpm: bool | None = None
        self.windows: dict[int, GpmWindow] = {}  # GPU instance id -> its GPM window

    def collect(self, ctx: SampleContext) -> None:
        if self.device.mig_mode != "enabled":
            return
        seen = set()
        for handle, instance in mig_devices(ctx, self.device):
            gi = str(instance)
            mig_uuid = ctx.guarded(partial(self.device.call_on, handle, "nvmlDeviceGetUUID"))
            ctx.emit("nvml_gpu_mig_info", 1, gi, as_text(mig_uuid or ""))
            if instance in seen:  # another compute instance of a GPU instance already read
                continue
            seen.add(instance)
            memory = ctx.guarded(partial(self.device.call_on, handle, "nvmlDeviceGetMemoryInfo"))
            if memory is not None:
                ctx.emit("nvml_gpu_mig_memory_used_bytes", memory.used, gi)
                ctx.emit("nvml_gpu_mig_memory_total_bytes", memory.total, gi)
            rates = ctx.guarded(partial(self.device.call_on, handle, "nvmlDeviceGetUtilizationRates"))
            if rates is not None:
                ctx.emit("nvml_gpu_mig_utilization_ratio", min(max(rates.gpu / 100, 0.0), 1.0), gi)
            self._gpm(ctx, instance, gi)
        for gone in set(self.windows) - seen:  # a GPU instance destroyed by a MIG reconfiguration
            self.windows.pop(gone).close()

    def _gpm(self, ctx: SampleContext, instance: int, gi: str) -> None:
        if self.gpm is None:
            self.gpm = gpm_supported(ctx, self.device)
        if not self.gpm or self.device.lacks("nvmlGpmMigSampleGet", instance):
            return
        window = self.windows.get(instance)
        if window is None:
            window = self.windows[instance] = GpmWindow(
                self.device, lambda buffer: self.device.call("nvmlGpmMigSampleGet", instance, buffer))
        for suffix, ratio in window.read(ctx).items():
            ctx.emit(f"nvml_gpu_mig_{suffix}", ratio, gi)

    def restart(self) -> None:
        for window in self.windows.values():
            window.restart()

    def close(self) -> None:
        for window in self.windows.values():
            window.close()
        self.windows = {}
