"""torch is optional: the hook works with Python numbers when it is not installed."""
from __future__ import annotations

try:
    import torch
except ImportError:  # pragma: no cover - exercised only without the `torch` extra
    torch = None  # type: ignore[assignment]

#: The tensor type for isinstance checks; an empty tuple matches nothing without torch.
TENSOR_TYPES: tuple[type, ...] = (torch.Tensor,) if torch is not None else ()


def cuda_ready() -> bool:
    """CUDA is present and already initialised by the training code (we never initialise it)."""
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
