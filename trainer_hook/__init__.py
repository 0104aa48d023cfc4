"""dualtrack's model track: training metrics to Prometheus without slowing or crashing training.

    from trainer_hook import TrainingMonitor, grad_norm

The names are loaded on first use, so that `import trainer_hook.contract` (the metric contract the
`dualtrack` command shares) does not load torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .gradnorm import grad_norm
    from .monitor import TrainingMonitor

__all__ = ["TrainingMonitor", "grad_norm"]


def __getattr__(name: str) -> Any:
    if name == "TrainingMonitor":
        from .monitor import TrainingMonitor
        return TrainingMonitor
    if name == "grad_norm":
        from .gradnorm import grad_norm
        return grad_norm
    raise AttributeError(f"module 'trainer_hook' has no attribute {name!r}")
