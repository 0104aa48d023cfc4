"""PyTorch Lightning: `Trainer(..., callbacks=[DualtrackCallback(job="my-job")])`.

Works with `lightning` (`lightning.pytorch.Trainer`) and the older `pytorch_lightning` package: the
callback is an instance of whichever Callback classes are installed.

Per optimizer step: the loss `training_step` returned (mean over accumulated batches), the grad
norm before clipping (the norm Lightning's clipping by norm computes; without it one fused read in
`on_before_optimizer_step`; DeepSpeed's global norm; under FSDP the `grad_norm` your training_step
returns), the learning rate, the epoch, samples, the batch id (the epoch and `batch_idx` of the
step's first batch) and the time the loop waited for its batches. With "16-mixed" (a GradScaler),
the steps it skips on an overflow and its loss scale; the norm is unscaled also for fused
optimizers, which Lightning leaves scaled until their step.
Nothing is read to the host on the training thread.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from .._torch import torch
from ..gradnorm import grad_norm
from ..watch import carried_scale, unscaled
from .common import DeferredMonitor, batch_size, require

require("lightning", "lightning", "lightning.pytorch", "pytorch_lightning")


def _callback_bases() -> tuple[type, ...]:
    bases = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(name).Callback)
        except ImportError:
            continue
    return tuple(bases)


#: Trainer settings exported as hyper-parameters, next to the LightningModule's hparams.
TRAINER_KEYS = ("max_epochs", "max_steps", "accumulate_grad_batches", "gradient_clip_val",
                "precision", "world_size")


class DualtrackCallback(*_callback_bases(), DeferredMonitor):  # type: ignore[misc]
    """Publishes a Lightning Trainer's steps through a TrainingMonitor (same arguments, plus
    `rank_zero_only`). The monitor starts at `on_fit_start` with `trainer.global_rank` and the
    module's `hparams` plus TRAINER_KEYS under your `config`."""

    def __init__(self, *args: Any, rank_zero_only: bool = False, **kwargs: Any) -> None:
        DeferredMonitor.__init__(self, *args, rank_zero_only=rank_zero_only, **kwargs)
        self._logged_step: int | None = None
        self._norm_from = "fused"
        self._scaler: Any = None
        self._step_reset()

    def _step_reset(self) -> None:
        self._loss: Any = None  # tensors or numbers, as Lightning gives them
        self._grad_norm: Any = None
        self._lr: Any = None
        self._samples: int | None = None
        self._batch_id: dict[str, Any] | None = None
        self._wait = 0.0

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        config = {key: getattr(trainer, key) for key in TRAINER_KEYS if hasattr(trainer, key)}
        config["strategy"] = type(trainer.strategy).__name__
        config.update(dict(getattr(pl_module, "hparams", None) or {}))
        self._logged_step = trainer.global_step
        if self.open(trainer.global_rank, config, type(pl_module).__name__) is not None:
            self._norm_from = self._grad_norm_source(trainer)
            self._scaler = getattr(trainer.precision_plugin, "scaler", None)  # "16-mixed"
            self.watch_scaler(self._scaler)
            self.patch(trainer, "save_checkpoint", self.paused_during("checkpoint"))  # ModelCheckpoint's saves

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.pause("evaluation")

    def _grad_norm_source(self, trainer: Any) -> str:
        """Where this run's total grad norm comes from: "deepspeed" (the engine's global norm),
        "clipping" (Lightning's clipping by norm, kept), "fused" (one read), or "returned" (only
        a `grad_norm` training_step returns: a sharded strategy, where a rank has a shard)."""
        strategy = type(trainer.strategy).__name__
        if "DeepSpeed" in strategy:
            return "deepspeed"
        if "FSDP" in strategy or "ModelParallel" in strategy:
            self.warn_once("sharded", f"DualtrackCallback: under {strategy} this rank holds only a "
                                      "shard of the gradients; return the global norm as 'grad_norm' "
                                      "from training_step (e.g. clip_grad_norm_'s result) to report it")
            return "returned"
        plugin = trainer.strategy.precision_plugin
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        if (trainer.gradient_clip_val and (algorithm or "norm") == "norm"
                and type(plugin).clip_grad_by_norm.__qualname__ == "Precision.clip_grad_by_norm"):

            def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:  # Lightning's own, kept
                self._grad_norm = torch.nn.utils.clip_grad_norm_(plugin.main_params(optimizer), clip_val)

            self.patch(plugin, "clip_grad_by_norm", lambda original: clip_grad_by_norm)
            return "clipping"
        return "fused"

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.batch_ended()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.resume()
        self.batch_ended()  # validation between batches is not waiting for data

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._wait += self.batch_started() or 0.0
        if self._batch_id is None:  # the step's first batch (more follow with accumulation)
            self._batch_id = {"epoch": trainer.current_epoch, "batch_idx": batch_idx}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.monitor is None:
            return
        self._lr = optimizer.param_groups[0]["lr"]
        if self._norm_from == "fused":  # not yet clipped; fused optimizers are not unscaled yet
            scale = carried_scale(optimizer, self._scaler)
            self._grad_norm = unscaled(grad_norm(pl_module.parameters()), scale)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.monitor is not None:
            mapping = isinstance(outputs, Mapping)
            loss = outputs.get("loss") if mapping else outputs
            if loss is not None and hasattr(loss, "detach"):
                # Lightning divides the loss by accumulate_grad_batches: the sum is the step's mean.
                self._loss = loss if self._loss is None else self._loss + loss
            if mapping and outputs.get("grad_norm") is not None:
                self._grad_norm = outputs["grad_norm"]
            size = batch_size(batch)
            if size is not None:
                self._samples = (self._samples or 0) + size
            if trainer.global_step != self._logged_step:  # the optimizer stepped
                self._log_step(trainer)
        self.batch_ended()

    def _log_step(self, trainer: Any) -> None:
        self._logged_step = trainer.global_step
        if self._norm_from == "deepspeed":  # computed by the engine's step
            self._grad_norm = trainer.strategy.deepspeed_engine.get_global_grad_norm()
        self.log_step(trainer.global_step, trainer.current_epoch, self._loss, self._grad_norm,
                      self._lr, samples=self._samples, data_wait=self._wait, batch_id=self._batch_id)
        self._step_reset()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close(failed=True, reason=type(exception).__name__)
