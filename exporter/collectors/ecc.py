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

    def _readings(self) -> list[tuple[str, int, tuple[str, ...]]]:
        lib = self.device.nvml.lib
        return [
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

    def fields(self):
        return [(field_id, 0) for _, field_id, _ in self._readings()]

    def collect(self, ctx: SampleContext) -> None:
        for metric, field_id, labels in self._readings():
            ctx.emit(metric, ctx.field(field_id), *labels)
