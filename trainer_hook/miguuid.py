"""Legacy MIG names in CUDA_VISIBLE_DEVICES, as NVML names the MIG device.

Drivers before R470 named a MIG device `MIG-GPU-<parent uuid>/<GPU instance>/<compute instance>`,
and CUDA still accepts that spelling; NVML (and so the exporter's `mig_uuid` label) names it
`MIG-<uuid>`. The hook asks NVML which MIG device the legacy name means, once, where it meets one.
"""
from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)

_LEGACY = re.compile(r"MIG-(GPU-[0-9A-Fa-f-]+)/(\d+)/(\d+)")


def normalised_mig_uuid(entry: str, nvml: Any = None) -> str:
    """`entry` with a legacy MIG name replaced by its MIG device's `MIG-<uuid>`; `entry` unchanged where
    it is not one, or NVML (`nvml`: the pynvml module by default) cannot say."""
    match = _LEGACY.fullmatch(entry)
    if match is None:
        return entry
    parent_uuid, instance, compute = match.group(1), int(match.group(2)), int(match.group(3))
    try:
        if nvml is None:
            import pynvml
            nvml = pynvml
        nvml.nvmlInit()
        try:
            parent = nvml.nvmlDeviceGetHandleByUUID(parent_uuid.encode())
            for index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(parent)):
                try:
                    handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
                except nvml.NVMLError:  # an empty slot
                    continue
                if (nvml.nvmlDeviceGetGpuInstanceId(handle), nvml.nvmlDeviceGetComputeInstanceId(handle)) \
                        == (instance, compute):
                    uuid = nvml.nvmlDeviceGetUUID(handle)
                    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        finally:
            nvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no NVML here (no driver, no binding): the name stays
        log.debug("cannot resolve %s through NVML: %s", entry, exc)
    return entry
