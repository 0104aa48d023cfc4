"""The NVML vocabulary the simulated driver speaks: constants with their values from nvml.h, and how a
field's value type is written into pynvml's value union.

The constants are fixed here, so that the simulated driver does not change with the installed
nvidia-ml-py (whose NVML_NVLINK_MAX_LINKS, for one, went from 18 to 36); they are installed on the
simulated module over the binding's own values.
"""
from __future__ import annotations

import ctypes
import struct
import types
from typing import Any

NVML_H: dict[str, int] = {
    "NVML_SUCCESS": 0, "NVML_ERROR_INVALID_ARGUMENT": 2, "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NOT_FOUND": 6, "NVML_ERROR_GPU_IS_LOST": 15, "NVML_ERROR_UNKNOWN": 999,
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_VALUE_TYPE_DOUBLE": 0, "NVML_VALUE_TYPE_UNSIGNED_INT": 1, "NVML_VALUE_TYPE_UNSIGNED_LONG": 2,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3, "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 4,
    "NVML_VALUE_TYPE_SIGNED_INT": 5, "NVML_VALUE_TYPE_UNSIGNED_SHORT": 6,
    "NVML_CLOCK_GRAPHICS": 0, "NVML_CLOCK_SM": 1, "NVML_CLOCK_MEM": 2, "NVML_CLOCK_VIDEO": 3,
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN": 0, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN": 1,
    "NVML_TEMPERATURE_THRESHOLD_MEM_MAX": 2, "NVML_TEMPERATURE_THRESHOLD_GPU_MAX": 3,
    "NVML_GPU_UTILIZATION_SAMPLES": 1, "NVML_PCIE_UTIL_TX_BYTES": 0, "NVML_PCIE_UTIL_RX_BYTES": 1,
    "NVML_NVLINK_MAX_LINKS": 18,
    "NVML_FI_DEV_ECC_SBE_VOL_TOTAL": 3, "NVML_FI_DEV_ECC_DBE_VOL_TOTAL": 4,
    "NVML_FI_DEV_RETIRED_SBE": 29, "NVML_FI_DEV_RETIRED_DBE": 30, "NVML_FI_DEV_RETIRED_PENDING": 31,
    "NVML_FI_DEV_MEMORY_TEMP": 82, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83,
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 94,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": 138, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": 139,
    "NVML_FI_DEV_REMAPPED_COR": 142, "NVML_FI_DEV_REMAPPED_UNC": 143, "NVML_FI_DEV_REMAPPED_PENDING": 144,
    "NVML_FI_DEV_REMAPPED_FAILURE": 145,
    "NVML_FI_DEV_POWER_AVERAGE": 185, "NVML_FI_DEV_POWER_INSTANT": 186, "NVML_FI_DEV_POWER_CURRENT_LIMIT": 190,
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 197, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 198,
    "NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES": 202, "NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES": 204,
    "NVML_GPM_METRIC_SM_UTIL": 2, "NVML_GPM_METRIC_ANY_TENSOR_UTIL": 5, "NVML_GPM_METRIC_DRAM_BW_UTIL": 10,
    "NVML_GPM_METRIC_PCIE_TX_PER_SEC": 20, "NVML_GPM_METRIC_PCIE_RX_PER_SEC": 21,
    "NVML_GPM_SUPPORT_VERSION": 1, "NVML_GPM_METRICS_GET_VERSION": 1,
    "nvmlEventTypeXidCriticalError": 0x8, "nvmlClocksEventReasonGpuIdle": 0x1,
    "nvmlClocksEventReasonSwThermalSlowdown": 0x20,
}
H = types.SimpleNamespace(**NVML_H)
NVLINK_SCOPE_ALL = 0xFFFFFFFF  # nvml.h: a field's scope id for "summed up across all links"
#: field_types for a driver that answers the PCIe byte counters at 32 bits (they wrap within a second)
PCIE_32_BIT = {H.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: H.NVML_VALUE_TYPE_UNSIGNED_INT,
               H.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: H.NVML_VALUE_TYPE_UNSIGNED_INT}

#: NVML_VALUE_TYPE_* -> the C type the driver writes into the c_nvmlValue_t union
VALUE_CTYPES: dict[int, Any] = {
    H.NVML_VALUE_TYPE_DOUBLE: ctypes.c_double, H.NVML_VALUE_TYPE_UNSIGNED_INT: ctypes.c_uint,
    H.NVML_VALUE_TYPE_UNSIGNED_LONG: ctypes.c_ulong, H.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: ctypes.c_ulonglong,
    H.NVML_VALUE_TYPE_SIGNED_LONG_LONG: ctypes.c_longlong, H.NVML_VALUE_TYPE_SIGNED_INT: ctypes.c_int,
    H.NVML_VALUE_TYPE_UNSIGNED_SHORT: ctypes.c_ushort,
}
#: NVML_VALUE_TYPE_* -> how the driver writes it into the union: a double as such; an integer as its
#: bits (unsigned layout of its width, so a signed one is two's complement) and the modulus it wraps at
VALUE_PACKING: dict[int, tuple[struct.Struct, int | None]] = {
    value_type: (struct.Struct("d"), None) if kind is ctypes.c_double else
    (struct.Struct(kind._type_.upper()), 1 << 8 * ctypes.sizeof(kind)) for value_type, kind in VALUE_CTYPES.items()}
#: c_nvmlFieldValue_t up to its value union: fieldId, scopeId, timestamp, latencyUsec, valueType, nvmlReturn
FIELD_HEAD = struct.Struct("@IIqqII")
