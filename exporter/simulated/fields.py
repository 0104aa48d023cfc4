"""Field values (nvmlDeviceGetFieldValues): a batch of counters and readings, each answered in the value
type the driver picks for it (`DeviceTraits.field_types`: an unsigned value wraps at its width, so
PCIE_32_BIT wraps the PCIe byte counters within a second) and its own return code. A Blackwell GPU
(`DeviceTraits.nvlink5`) has its NVLink counters in NVLink5's fields only.

The batch is written as the driver writes it, into the struct array's memory: set member by member
through pynvml's structs (whose __setattr__ is Python), one batch cost the simulation ten other calls'
worth of CPU, charged to the process that hosts it."""
from __future__ import annotations

import ctypes
from typing import Any

from exporter.simulated.driver import Driver, nvml_function
from exporter.simulated.nvml_h import FIELD_HEAD, NVLINK_SCOPE_ALL, VALUE_PACKING, H
from exporter.simulated.workload import PCIE_COUNTER_START, PCIE_RX_BUSY_RATE, PCIE_RX_RATE, PCIE_TX_RATE

_NVLINK_FIELDS = (H.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, H.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
_NVLINK5_FIELDS = (H.NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES, H.NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES)
_POWER_FIELDS = (H.NVML_FI_DEV_POWER_INSTANT, H.NVML_FI_DEV_POWER_CURRENT_LIMIT, H.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION)
#: the fields whose simulated value never changes (the others are computed in Fields._field)
_CONSTANT_FIELDS = {H.NVML_FI_DEV_POWER_CURRENT_LIMIT: 700_000, H.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: 0,
                    H.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: 0, H.NVML_FI_DEV_REMAPPED_COR: 0, H.NVML_FI_DEV_REMAPPED_UNC: 0,
                    H.NVML_FI_DEV_REMAPPED_PENDING: 0, H.NVML_FI_DEV_REMAPPED_FAILURE: 0,
                    H.NVML_FI_DEV_PCIE_REPLAY_COUNTER: 0}


class Fields(Driver):
    """NVML's field values."""

    @nvml_function
    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[int | tuple[int, int]]) -> Any:
        gpu = self._gpu(handle)
        t = self._t()
        busy = self.workload.busy_seconds(gpu, t)
        types = self.traits[gpu].field_types
        stamp = int(self.clock() * 1e6)
        struct_type = self.c_nvmlFieldValue_t
        size, value_at = ctypes.sizeof(struct_type), struct_type.value.offset
        memory = bytearray(size * len(field_ids))
        for offset, requested in zip(range(0, len(memory), size), field_ids):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            error = self._scope_error(field_id, scope)
            reading = None if error else self._field(gpu, field_id, scope, t, busy)
            value_type = 0
            if error is None and reading is None:
                error = H.NVML_ERROR_NOT_SUPPORTED
            elif error is None and reading is not None:
                value_type = types.get(field_id, H.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG)
                packing, wraps_at = VALUE_PACKING[value_type]
                packing.pack_into(memory, offset + value_at, reading if wraps_at is None else int(reading) % wraps_at)
            FIELD_HEAD.pack_into(memory, offset, field_id, scope, stamp, 0, value_type, error or H.NVML_SUCCESS)
        return (struct_type * len(field_ids)).from_buffer(memory)

    @staticmethod
    def _scope_error(field_id: int, scope: int) -> int | None:
        """INVALID_ARGUMENT for a link id past NVML_NVLINK_MAX_LINKS (other than "all links")."""
        if (field_id in _NVLINK_FIELDS or field_id in _NVLINK5_FIELDS) and scope != NVLINK_SCOPE_ALL \
                and scope >= H.NVML_NVLINK_MAX_LINKS:
            return int(H.NVML_ERROR_INVALID_ARGUMENT)
        return None

    def _field(self, gpu: int, field_id: int, scope: int, t: float, busy: float) -> float | None:
        """Field `field_id` (of link `scope`) at time t, when the GPU had been busy `busy` seconds; None
        where the GPU does not have it."""
        traits = self.traits[gpu]
        if field_id in _NVLINK_FIELDS or field_id in _NVLINK5_FIELDS:
            # each link carries an equal share of 20 GB per busy second: KiB in the older fields, bytes in NVLink5's
            if (not traits.nvlinks or (scope != NVLINK_SCOPE_ALL and scope >= traits.nvlinks)
                    or traits.nvlink5 != (field_id in _NVLINK5_FIELDS)):
                return None
            unit = 1 if traits.nvlink5 else 1024
            return 20e9 * busy / unit / (1 if scope == NVLINK_SCOPE_ALL else traits.nvlinks)
        if field_id in _POWER_FIELDS and not traits.power:
            return None
        if field_id == H.NVML_FI_DEV_MEMORY_TEMP:
            return 40 + 20 * self.workload.utilization(gpu, t)
        if field_id == H.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            return self.workload.energy_mj(gpu, t)
        if field_id == H.NVML_FI_DEV_POWER_INSTANT:
            return self.workload.power_mw(gpu, t)
        if field_id == H.NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
            return (PCIE_COUNTER_START + int(PCIE_TX_RATE * t)) % 2**64
        if field_id == H.NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
            return (PCIE_COUNTER_START + int(PCIE_RX_RATE * t + PCIE_RX_BUSY_RATE * busy)) % 2**64
        return _CONSTANT_FIELDS.get(field_id)
