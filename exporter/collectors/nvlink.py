"""NVLink payload traffic over all links. nvidia-smi: `nvidia-smi nvlink -gt d`.

NVML fields NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX (KiB counters), read with the scope id
0xFFFFFFFF, which nvml.h defines as "summed up across all links": two fields per sample, and no
per-link sum in which one failing link would read as a counter reset. A GPU without NVLink answers
NOT_SUPPORTED once and exports no series.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext

KIB = 1024
ALL_LINKS = 0xFFFFFFFF  # nvml.h: the scope id of a field summed up across all links


class NvlinkCollector(Collector):
    name = "nvlink"
    help = "NVLink data bytes"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        self.directions = {"tx": lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                           "rx": lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX}

    def fields(self):
        return [(field_id, ALL_LINKS) for field_id in self.directions.values()]

    def collect(self, ctx: SampleContext) -> None:
        for direction, field_id in self.directions.items():
            kib = ctx.field(field_id, ALL_LINKS)
            ctx.emit("nvml_gpu_nvlink_data_bytes_total", None if kib is None else kib * KIB, direction)
