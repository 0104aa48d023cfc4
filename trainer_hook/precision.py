"""Which precision the model's matmuls run at, read from the model rather than assumed: the label of
training_model_flops_total, whose MFU divides by the GPUs' dense peak at that precision.

In order: autocast around the model's first forward (its dtype), a GradScaler that is enabled (fp16),
the parameters' dtype (fp32 on a GPU that allows TF32 matmuls: tf32). Nothing read: "unknown", and the
run has no MFU rather than a wrong one.
"""
from __future__ import annotations

from typing import Any

from ._torch import torch
from .contract import DEFAULT_PRECISION

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def of_dtype(dtype: Any) -> str | None:
    """bf16, fp16, fp32 or fp8 for a torch dtype; None for others (fp64, integers)."""
    return _DTYPES.get(str(dtype).removeprefix("torch."))


def of_parameters(params: list[Any], scaler: Any = None) -> str:
    """The precision a model with these parameters trains at, with `scaler` (a GradScaler or None)."""
    if scaler is not None and _enabled(scaler):
        return "fp16"
    first = next((p for p in params if hasattr(p, "dtype")), None)
    found = of_dtype(first.dtype) if first is not None else None
    if found == "fp32" and getattr(first, "is_cuda", False) and torch is not None \
            and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return found or DEFAULT_PRECISION


def of_autocast(device_type: str) -> str | None:
    """The dtype autocast runs `device_type`'s matmuls at, if autocast is on there now; else None."""
    if torch is None:
        return None
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return of_dtype(torch.get_autocast_dtype(device_type))
    except (AttributeError, TypeError, RuntimeError):  # torch < 2.4: no per-device query
        return None


def _enabled(scaler: Any) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    try:
        return bool(is_enabled()) if callable(is_enabled) else True
    except Exception:  # noqa: BLE001 - a scaler-like object of another library
        return True
