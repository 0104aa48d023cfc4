"""Model FLOPs per step (training_model_flops_total): the user's figures, else an estimate.

The figures are fixed numbers set once (TrainingMonitor's flops_per_token / flops_per_sample, or
watch()'s parameter count); the background thread multiplies them by each step's tokens or samples.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: FLOPs per parameter per token of a dense transformer's training step: 2 forward, 4 backward
#: (Kaplan et al. 2020, "Scaling Laws for Neural Language Models"); attention's own FLOPs are left out.
FLOPS_PER_PARAMETER_TOKEN = 6


@dataclass
class ModelFlops:
    """How many model FLOPs a step did, from its tokens or samples.

    The user's figures win: with flops_per_token or flops_per_sample given, the estimate is not used.
    """

    per_token: float | None = None
    per_sample: float | None = None
    estimated_per_token: float | None = None  # 6 x the parameters watch() saw

    def of(self, tokens: float | None, samples: float | None) -> float | None:
        """The step's model FLOPs, or None when its tokens (samples) are not known."""
        if self.per_token is not None or self.per_sample is not None:
            if self.per_token is not None and tokens is not None:
                return tokens * self.per_token
            if self.per_sample is not None and samples is not None:
                return samples * self.per_sample
            return None
        if self.estimated_per_token is not None and tokens is not None:
            return tokens * self.estimated_per_token
        return None


def estimate_per_token(params: Iterable[Any]) -> float:
    """6 x the number of parameters: a dense transformer's training FLOPs per token (an estimate)."""
    return float(FLOPS_PER_PARAMETER_TOKEN * sum(param.numel() for param in params))
