"""Hugging Face Trainer: `Trainer(..., callbacks=[DualtrackCallback(job="my-job")])`.

Per optimizer step: the raw loss (what `training_step` returned, before `logging_nan_inf_filter`),
the grad norm the Trainer's own clipping computed (global under FSDP/DeepSpeed), the learning rate,
the fractional epoch, samples and tokens of the step's batches, the batch id (the step and the index
of its first sample among those this rank trained on), and the time the loop waited for them.
With fp16 (a GradScaler), the steps it skips on an overflow and its loss scale.
Nothing is read to the host on the training thread.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..watch import whole_grad_norm
from .common import DeferredMonitor, batch_size, calling_instance, engine_grad_norm, require

transformers: Any = require("huggingface", "huggingface", "transformers")

#: TrainingArguments fields exported as hyper-parameters (training_run_info labels).
CONFIG_KEYS = ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps",
               "num_train_epochs", "max_steps", "weight_decay", "adam_beta1", "adam_beta2",
               "warmup_steps", "lr_scheduler_type", "optim", "max_grad_norm", "seed", "fp16", "bf16",
               "world_size")


class DualtrackCallback(transformers.TrainerCallback, DeferredMonitor):
    """Publishes a Trainer's steps through a TrainingMonitor (same arguments, plus `rank_zero_only`).

    The monitor starts at `on_train_begin` with the Trainer's rank (`args.process_index`) and its
    TrainingArguments (CONFIG_KEYS, and the model type) under your `config`.
    """

    def __init__(self, *args: Any, rank_zero_only: bool = False, **kwargs: Any) -> None:
        DeferredMonitor.__init__(self, *args, rank_zero_only=rank_zero_only, **kwargs)
        self._accelerator: Any = None
        self._sample = 0  # samples this rank trained on before the current step
        self._step_reset()

    def _step_reset(self) -> None:
        self._loss: Any = None  # tensors or numbers, as the Trainer gives them
        self._grad_norm: Any = None
        self._lr: Any = None
        self._samples: int | None = None
        self._tokens: Any = None
        self._wait: float | None = None
        self._batch_id: dict[str, Any] | None = None

    # ----------------------------------------------------------------- start and end
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        config = {key: getattr(args, key) for key in CONFIG_KEYS if hasattr(args, key)}
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type:
            config["model_type"] = model_type
        job = args.run_name or Path(args.output_dir or "huggingface").name
        if self.open(args.process_index, config, job) is None:
            return
        # A resumed run starts after the samples of the steps it skips.
        self._sample = state.global_step * args.per_device_train_batch_size * args.gradient_accumulation_steps
        trainer = calling_instance(transformers.Trainer)
        if trainer is None:
            self.warn_once("trainer", "DualtrackCallback: no Trainer found calling it; loss and grad "
                                      "norm are not reported")
            return
        self.patch(trainer, "training_step", self._wrap_training_step)
        # The callbacks hear of an evaluation and a save only after them: the Trainer's own methods
        # run inside monitor.paused() instead (_save_checkpoint: its periodic checkpoint).
        self.patch(trainer, "evaluate", self.paused_during("evaluation"))
        if callable(getattr(trainer, "_save_checkpoint", None)):
            self.patch(trainer, "_save_checkpoint", self.paused_during("checkpoint"))
        self._accelerator = getattr(trainer, "accelerator", None)
        if self._accelerator is not None:
            self.patch(self._accelerator, "clip_grad_norm_", self.capture_result("_grad_norm"))
            self.watch_scaler(getattr(self._accelerator, "scaler", None))
        self.batch_ended()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._accelerator = None
        self.close()

    def _wrap_training_step(self, training_step: Callable) -> Callable:
        def wrapped(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = training_step(model, inputs, *args, **kwargs)
            # Micro-batch losses are already divided by the accumulation steps: their sum is the step's.
            self._loss = loss if self._loss is None else self._loss + loss
            size = batch_size(inputs)
            if size is not None:
                self._samples = (self._samples or 0) + size
            tokens = _tokens(inputs)
            if tokens is not None:
                self._tokens = tokens if self._tokens is None else self._tokens + tokens
            return loss
        return wrapped

    # ----------------------------------------------------------------- per step
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._wait = self.batch_started()
        self._batch_id = {"step": state.global_step + 1, "sample": self._sample}

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                          model: Any = None, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        if optimizer is not None:
            self._lr = optimizer.param_groups[0]["lr"]
        if self._grad_norm is None:  # DeepSpeed: the engine's norm (clip_grad_norm_ may give None)
            self._grad_norm = engine_grad_norm(self._accelerator)
        if self._grad_norm is None and model is not None:
            if args.max_grad_norm and args.max_grad_norm > 0:
                self.warn_once("grad_norm", "DualtrackCallback: the Trainer's grad norm was not "
                                            "captured; grad_norm is not reported")
            else:  # nothing clipped the gradients: one fused read, if this rank has them whole
                self._grad_norm, why = whole_grad_norm(list(model.parameters()), model=model)
                if why:
                    self.warn_once("grad_norm", f"DualtrackCallback: {why}, so their norm would not "
                                                "be the model's; grad_norm is not reported")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.log_step(state.global_step, state.epoch, self._loss, self._grad_norm, self._lr,
                          samples=self._samples, tokens=self._tokens, data_wait=self._wait,
                          batch_id=self._batch_id)
            self._sample += self._samples or 0
        self._step_reset()
        self.batch_ended()

    # Evaluation, logging and checkpoints between two steps are not waiting for data.
    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.batch_ended()

    on_save = on_evaluate = on_log


def _tokens(inputs: Any) -> Any:
    """Non-padding tokens of a batch (a device tensor, not read), or all input_ids; None if unknown."""
    if not hasattr(inputs, "get"):
        return None
    mask = inputs.get("attention_mask")
    if mask is not None:
        return mask.sum()
    ids = inputs.get("input_ids")
    return ids.numel() if ids is not None else None
