"""GPU identity: nvml_gpu_info, from what the device read once when it was opened (no NVML call).

nvidia-smi: name, pci.bus_id, mig.mode.current. NVML: nvmlDeviceGetName, nvmlDeviceGetPciInfo_v3,
nvmlDeviceGetMigMode (exporter.nvml.Device.open). Always on: every GPU series joins on it.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext


class IdentityCollector(Collector):
    name = "identity"
    help = "GPU identity (always on)"

    def __init__(self, device, *, simulated: bool = False, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.simulated = "true" if simulated else "false"
        self.series: dict[tuple[str, ...], float] = {}  # handed back unchanged while the identity is

    def collect(self, ctx: SampleContext) -> None:
        device = self.device
        labels = (device.name, device.pci_bus_id, device.mig_mode, self.simulated)
        if labels not in self.series:
            self.series = {labels: 1.0}
        ctx.emit_series("nvml_gpu_info", self.series)
