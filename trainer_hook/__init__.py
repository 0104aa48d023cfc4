"""dualtrack's model track: training metrics to Prometheus without slowing or crashing training.

    from trainer_hook import TrainingMonitor, grad_norm
"""
from .gradnorm import grad_norm
from .monitor import TrainingMonitor

__all__ = ["TrainingMonitor", "grad_norm"]
