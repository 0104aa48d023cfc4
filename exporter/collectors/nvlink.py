"""NVLink payload traffic over all links. nvidia-smi: `nvidia-smi nvlink -gt d`.

NVML fields NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX (KiB counters), read with the scope id
0xFFFFFFFF, which nvml.h defines as "summed up across all links": two fields per sample, and no
per-link sum in which one failing link would read as a counter reset. NVLink5 (Blackwell) answers those
NOT_SUPPORTED and has its own counters, NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES / _RCV_BYTES (bytes, same
scope): they are read where the older fields are absent. A GPU without NVLink answers NOT_SUPPORTED to
both and exports no series; absent fields are asked again every few minutes (NVLink counters can appear
once the fabric manager is up).
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import constant

KIB = 1024
ALL_LINKS = 0xFFFFFFFF  # nvml.h: the scope id of a field summed up across all links


class NvlinkCollector(Collector):
    name = "nvlink"
    help = "NVLink data bytes"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        # direction -> (the NVLink 1-4 KiB counter, the NVLink5 byte counter)
        self.directions = {"tx": (lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                                  constant(lib, "NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES")),
                           "rx": (lib.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
                                  constant(lib, "NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES"))}

    def fields(self):
        return [(field_id, ALL_LINKS) for pair in self.directions.values() for field_id in pair]

    def collect(self, ctx: SampleContext) -> None:
        for direction, (kib_field, bytes_field) in self.directions.items():
            kib = ctx.field(kib_field, ALL_LINKS)
            if kib is not None:
                ctx.emit("nvml_gpu_nvlink_data_bytes_total", kib * KIB, direction)
            elif self.device.lacks_field(kib_field, ALL_LINKS):
                ctx.emit("nvml_gpu_nvlink_data_bytes_total", ctx.field(bytes_field, ALL_LINKS), direction)
