"""Shared pieces of the framework-integration tests."""
from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.support.hook import pushed_value, wait_pushed


def final_pushed(pushgateway_url: str, run: str, *names: str, **labels: str) -> dict[str, float | None]:
    """The values `run` pushed last, once it pushed its finished state (one push holds them all)."""
    wait_pushed(pushgateway_url, "training_run_state", run, lambda v: v == 1, state="finished")
    return {name: pushed_value(pushgateway_url, name, run, **labels) for name in names}


def slow_loader(x: torch.Tensor, y: torch.Tensor, batch: int, delay: float = 0.0) -> DataLoader:
    """A DataLoader over (x, y) whose every batch takes `delay` seconds to load."""

    class Slow(TensorDataset):
        def __getitem__(self, index: int):
            if index % batch == 0:
                time.sleep(delay)  # a slow input pipeline, once per batch
            return super().__getitem__(index)

    return DataLoader(Slow(x, y), batch_size=batch)


def gpu_fp16_on_cpu(accelerator: Any, init_scale: float = 2.0 ** 20) -> torch.amp.GradScaler:
    """What Accelerate sets up for mixed_precision="fp16" on a GPU, on this CPU-only machine (where
    it sets up nothing): a torch GradScaler (here on CPU) and native AMP, so that prepare() runs the
    model's forward in fp16 autocast and unscale_gradients() unscales. Call before prepare().

    The scale starts high (it overflows, backs off, grows every 2 steps and overflows again)."""
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    accelerator.native_amp = True
    return accelerator.scaler


class DeepSpeedEngine:
    """What the integrations use of `deepspeed.runtime.engine.DeepSpeedEngine` (DeepSpeed itself does
    not run on this CPU-only machine): `engine.step()` computes the norm of the gradients over all
    partitions, clips and steps; `get_global_grad_norm()` returns that norm. `zero_step(params)`
    plays that step on one process: the norm of the whole gradients, then, as under ZeRO-2/3, no
    `p.grad` left (the gradients live in DeepSpeed's partitions)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def zero_step(self, parameters: Any) -> None:
        parameters = list(parameters)
        self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in parameters])))
        for param in parameters:
            param.grad = None

    def get_global_grad_norm(self) -> float | None:
        return self.norms[-1] if self.norms else None

    def destroy(self) -> None:
        """Called by accelerate's free_memory()."""
