"""What the simulated GPUs are: the system's GPUs, their names, UUIDs and PCI bus ids, and their MIG
devices (a GPU in MIG mode splits into GPU instances, each with its compute instances)."""
from __future__ import annotations

import ctypes
import uuid as uuidlib
from typing import Any

import pynvml

from exporter.simulated.driver import Driver, nvml_function
from exporter.simulated.workload import MIG_SLOTS

_BUS_IDS = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


class Identity(Driver):
    """NVML's system and device identity functions."""

    @nvml_function
    def nvmlSystemGetDriverVersion(self) -> str:
        return "simulated"

    @nvml_function
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 12040

    @nvml_function
    def nvmlDeviceGetCount(self) -> int:
        return len(self.traits)

    @nvml_function
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self._handles):
            raise pynvml.NVMLError_InvalidArgument()
        return self._handles[index]

    @nvml_function
    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> Any:
        ctypes.c_char_p(uuid)  # like pynvml: a str here is a TypeError
        gpu = self._gpu_of(uuid)
        if gpu is None:
            raise pynvml.NVMLError_NotFound()
        return self._handles[gpu]

    @nvml_function
    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self.traits[self._gpu(handle)].name

    @nvml_function
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        mig = self._mig_of(handle)
        if mig is not None:
            name = f"dualtrack-simulated-{mig[0]}-gi{mig[1]}" + (f"-ci{mig[2]}" if mig[2] else "")
            return f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, name)}"
        return self._uuids[self._gpu(handle)]

    @nvml_function
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        gpu = self._gpu(handle)
        bus = _BUS_IDS[gpu % len(_BUS_IDS)] + gpu // len(_BUS_IDS)
        info = pynvml.nvmlPciInfo_t()
        info.busId = f"00000000:{bus:02X}:00.0".encode()
        info.bus = bus
        return info

    # --- MIG --------------------------------------------------------------------------------------
    @nvml_function
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        mode = int(self.traits[self._gpu(handle)].mig)
        return [mode, mode]

    @nvml_function
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        return MIG_SLOTS if self.traits[self._gpu(handle)].mig else 0

    @nvml_function
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any:
        gpu = self._gpu(handle)
        if not self.traits[gpu].mig or not 0 <= index < MIG_SLOTS:
            raise pynvml.NVMLError_InvalidArgument()
        if index >= len(self._mig_devices[gpu]):
            raise pynvml.NVMLError_NotFound()
        return self._mig_devices[gpu][index]

    @nvml_function
    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        return self._mig_ids(handle)[0]

    @nvml_function
    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        return self._mig_ids(handle)[1]

    def _mig_ids(self, handle: Any) -> tuple[int, int]:
        """(GPU instance id, compute instance id) of a MIG device; INVALID_ARGUMENT for a whole GPU."""
        mig = self._mig_of(handle)
        if mig is None:
            raise pynvml.NVMLError_InvalidArgument()
        return mig[1], mig[2]
