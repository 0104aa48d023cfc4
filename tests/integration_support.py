"""Shared pieces of the framework-integration tests."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SyncCounter(TorchDispatchMode):
    """Counts device-to-host reads (`aten._local_scalar_dense`: .item(), float(), `if tensor`)
    made on this thread while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
