"""GPU identity: nvml_gpu_info, from what the device read when it was opened, and its MIG mode.

nvidia-smi: name, pci.bus_id, mig.mode.current. NVML: nvmlDeviceGetName, nvmlDeviceGetPciInfo_v3
(exporter.nvml.Device.open), nvmlDeviceGetMigMode, read again every MIG_MODE_SECONDS: MIG is turned on
or off on a running node (`nvidia-smi -mig`, then a GPU reset), and the mig, memory and processes
collectors follow the mode. Always on: every GPU series joins on it.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext

#: Seconds between two reads of a GPU's MIG mode.
MIG_MODE_SECONDS = 60.0


class IdentityCollector(Collector):
    name = "identity"
    help = "GPU identity (always on)"

    def __init__(self, device, *, simulated: bool = False, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.simulated = "true" if simulated else "false"
        self.series: dict[tuple[str, ...], float] = {}  # handed back unchanged while the identity is
        self.mode_read_at: float | None = None  # the sample time the MIG mode was last read (None: at open)

    def collect(self, ctx: SampleContext) -> None:
        device = self.device
        if self.mode_read_at is None:
            self.mode_read_at = ctx.now
        elif ctx.now - self.mode_read_at >= MIG_MODE_SECONDS:
            self.mode_read_at = ctx.now
            device.read_mig_mode()
        labels = (device.name, device.pci_bus_id, device.mig_mode, self.simulated)
        if labels not in self.series:
            self.series = {labels: 1.0}
        ctx.emit_series("nvml_gpu_info", self.series)
