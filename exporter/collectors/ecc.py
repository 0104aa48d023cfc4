"""Memory errors: ECC counts, retired pages (pre-Ampere) and remapped rows (Ampere+).

nvidia-smi: ecc.errors.{corrected,uncorrected}.volatile.total, retired_pages.{sbe,dbe,pending},
remapped_rows.{correctable,uncorrectable,pending,failure}. NVML fields NVML_FI_DEV_ECC_*_VOL_TOTAL,
NVML_FI_DEV_RETIRED_*, NVML_FI_DEV_REMAPPED_*, all in the shared field batch.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext


class EccCollector(Collector):
    name = "ecc"
    help = "ECC errors, retired pages, remapped rows"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        self.readings: list[tuple[str, int, tuple[str, ...]]] = [
            ("nvml_gpu_ecc_errors_total", lib.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, ("corrected",)),
            ("nvml_gpu_ecc_errors_total", lib.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, ("uncorrected",)),
            ("nvml_gpu_retired_pages_total", lib.NVML_FI_DEV_RETIRED_SBE, ("single_bit_ecc",)),
            ("nvml_gpu_retired_pages_total", lib.NVML_FI_DEV_RETIRED_DBE, ("double_bit_ecc",)),
            ("nvml_gpu_retired_pages_pending", lib.NVML_FI_DEV_RETIRED_PENDING, ()),
            ("nvml_gpu_remapped_rows_total", lib.NVML_FI_DEV_REMAPPED_COR, ("correctable",)),
            ("nvml_gpu_remapped_rows_total", lib.NVML_FI_DEV_REMAPPED_UNC, ("uncorrectable",)),
            ("nvml_gpu_remapped_rows_pending", lib.NVML_FI_DEV_REMAPPED_PENDING, ()),
            ("nvml_gpu_remapped_rows_failure", lib.NVML_FI_DEV_REMAPPED_FAILURE, ()),
        ]
        # the last sample's readings and the series made of them: handed back unchanged while they are
        # (these counters almost never move)
        self.last: tuple[float | None, ...] | None = None
        self.series: dict[str, dict[tuple[str, ...], float]] = {}

    def fields(self):
        return [(field_id, 0) for _, field_id, _ in self.readings]

    def collect(self, ctx: SampleContext) -> None:
        readings = tuple(ctx.field(field_id) for _, field_id, _ in self.readings)
        if readings != self.last:
            self.last, self.series = readings, {}
            for (metric, _, labels), value in zip(self.readings, readings):
                if value is not None:
                    self.series.setdefault(metric, {})[labels] = float(value)
        for metric, series in self.series.items():
            ctx.emit_series(metric, series)
