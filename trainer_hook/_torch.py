"""torch is optional: the hook works with Python numbers when it is not installed."""
from __future__ import annotations

import os
from typing import Any

from .miguuid import normalised_mig_uuid

try:
    import torch
except ImportError:  # pragma: no cover - exercised only without the `torch` extra
    torch = None  # type: ignore[assignment]

#: The tensor type for isinstance checks; an empty tuple matches nothing without torch.
TENSOR_TYPES: tuple[type[Any], ...] = (torch.Tensor,) if torch is not None else ()


def cuda_ready() -> bool:
    """CUDA is already initialised by the training code.

    Only `torch.cuda.is_initialized()` is asked: it reads a flag, where `is_available()` may
    query the driver, which must not happen before a DataLoader forks its workers.
    """
    return torch is not None and torch.cuda.is_initialized()


def cuda_uuid(index: int) -> str:
    """nvidia-smi's spelling of CUDA device `index`'s UUID (what the exporter's `uuid` label holds)."""
    props = torch.cuda.get_device_properties(index)
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    return device_uuid(props.name, str(props.uuid), visible[index] if index < len(visible) else "")


def device_uuid(name: str, uuid: str, visible: str = "") -> str:
    """`GPU-<uuid>` for a GPU, `MIG-<uuid>` for a MIG instance (CUDA names those "<GPU> MIG 1g.10gb").

    `visible`: the device's CUDA_VISIBLE_DEVICES entry; a `MIG-…` entry names the instance exactly (a
    legacy `MIG-GPU-<uuid>/<gi>/<ci>` one as NVML names it).
    """
    if visible.startswith("MIG-"):
        return normalised_mig_uuid(visible)
    if uuid.startswith(("GPU-", "MIG-")):
        return uuid
    return ("MIG-" if "MIG" in name.split() else "GPU-") + uuid
