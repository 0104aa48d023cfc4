"""NVLink payload traffic, summed over links. nvidia-smi: `nvidia-smi nvlink -gt d`.

NVML fields NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX (KiB counters) with the link as scope,
for every possible link in the one field batch; links a GPU lacks answer NOT_SUPPORTED once and are
then never asked again. A GPU without NVLink exports no series.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext

KIB = 1024


class NvlinkCollector(Collector):
    name = "nvlink"
    help = "NVLink data bytes"

    def _fields(self) -> dict[str, int]:
        lib = self.device.nvml.lib
        return {"tx": lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, "rx": lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX}

    def fields(self):
        links = range(self.device.nvml.lib.NVML_NVLINK_MAX_LINKS)
        return [(field_id, link) for field_id in self._fields().values() for link in links]

    def collect(self, ctx: SampleContext) -> None:
        links = range(self.device.nvml.lib.NVML_NVLINK_MAX_LINKS)
        for direction, field_id in self._fields().items():
            values = [v for v in (ctx.field(field_id, link) for link in links) if v is not None]
            if values:
                ctx.emit("nvml_gpu_nvlink_data_bytes_total", sum(values) * KIB, direction)
