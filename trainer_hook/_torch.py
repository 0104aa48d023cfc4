"""torch is optional: the hook works with Python numbers when it is not installed."""
from __future__ import annotations

try:
    import torch
except ImportError:  # pragma: no cover - exercised only without the `torch` extra
    torch = None  # type: ignore[assignment]

#: The tensor type for isinstance checks; an empty tuple matches nothing without torch.
TENSOR_TYPES: tuple[type, ...] = (torch.Tensor,) if torch is not None else ()


def cuda_ready() -> bool:
    """CUDA is already initialised by the training code.

    Only `torch.cuda.is_initialized()` is asked: it reads a flag, where `is_available()` may
    query the driver, which must not happen before a DataLoader forks its workers.
    """
    return torch is not None and torch.cuda.is_initialized()
