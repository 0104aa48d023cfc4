"""Accelerate: `Accelerator(log_with=[DualtrackTracker(job="my-job")])`.

What `accelerator.log(values, step=step)` receives goes to a TrainingMonitor: loss, learning rate
(`lr` or `learning_rate`), `epoch` and any other number, as tensors or numbers (tensors are not read
on the training thread); `samples`, `tokens` and `batch_id` keys become the step's counts. The grad
norm is the one `accelerator.clip_grad_norm_` returned since the previous log (global under FSDP),
under DeepSpeed the engine's global norm of its last step (`get_global_grad_norm()`, also when you
do not call `clip_grad_norm_`), unless you log `grad_norm` yourself.
With fp16 (the Accelerator's GradScaler), the steps it skips on an overflow and its loss scale.
`init_trackers(..., config=...)` becomes training_run_info, the rank is Accelerate's process index.
Wrap the dataloader in `tracker.loader(...)` to report data wait.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from .common import DeferredMonitor, calling_instance, engine_grad_norm, require

accelerate = require("accelerate", "accelerate", "accelerate")
from accelerate.tracking import GeneralTracker  # noqa: E402

#: log() keys that are counts of the step rather than metrics.
STEP_COUNTS = ("samples", "tokens", "batch_id")


class DualtrackTracker(GeneralTracker, DeferredMonitor):
    """An Accelerate tracker publishing through a TrainingMonitor (same arguments, plus
    `rank_zero_only`).

    `Accelerator.log` runs on the main process only: for every rank, call `tracker.log(...)`
    yourself on each one (the monitor starts on the first call, with that process's rank, or at the
    first fp16 optimizer step, so that it sees that step's overflow).
    """

    name = "dualtrack"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, *args: Any, rank_zero_only: bool = False, **kwargs: Any) -> None:
        DeferredMonitor.__init__(self, *args, rank_zero_only=rank_zero_only, **kwargs)
        GeneralTracker.__init__(self)
        self._config: dict[str, Any] = {}
        self._grad_norm: Any = None
        self._accelerator: Any = None

    @property
    def tracker(self) -> Any:
        """The TrainingMonitor (None before the first log() or on a rank that does not report)."""
        return self.monitor

    def start(self) -> None:
        """Called by `init_trackers` (recent versions): capture the Accelerator's grad norms."""
        accelerator = calling_instance(accelerate.Accelerator)
        if accelerator is not None:
            self._accelerator = accelerator
            self.patch(accelerator, "clip_grad_norm_", self.capture_result("_grad_norm"))
            self.patch(accelerator, "save_state", self.paused_during("checkpoint"))
            if getattr(accelerator, "scaler", None) is not None:  # fp16
                self.patch(accelerator.scaler, "step", self._opening)

    def _opening(self, step: Callable) -> Callable:
        """The GradScaler's step, opening the monitor at the first one if no log() did yet, so that
        the monitor counts that step's skip (the first steps are those that overflow)."""
        def opening(*args: Any, **kwargs: Any) -> Any:
            if self.monitor is None and self._monitor() is not None:
                return self._accelerator.scaler.step(*args, **kwargs)  # now through the monitor's watch
            return step(*args, **kwargs)
        return opening

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.start()  # older versions call only this one from init_trackers
        self._config.update(values)
        if self.monitor is not None:
            self.warn_once("config", "DualtrackTracker: configuration stored after the first log() "
                                     "is not exported")

    def _monitor(self) -> Any:
        """The monitor, started on first use with this process's rank and the stored config."""
        if self.monitor is None and self.open(accelerate.PartialState().process_index, self._config,
                                              "accelerate") is not None:
            self.watch_scaler(getattr(self._accelerator, "scaler", None))
        return self.monitor

    def loader(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from `iterable`, adding the time spent waiting for each item to data-wait
        (`TrainingMonitor.loader`; call it after `init_trackers`)."""
        monitor = self._monitor()
        return iter(iterable) if monitor is None else monitor.loader(iterable)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        monitor = self._monitor()
        if monitor is None:
            return
        values = dict(values)
        counts = {key: values.pop(key) for key in STEP_COUNTS if key in values}
        if not {"grad_norm", "gradnorm", "total_grad_norm"} & values.keys():
            # DeepSpeed clips inside its step: its engine holds the global norm of the last step
            norm = self._grad_norm if self._grad_norm is not None else engine_grad_norm(self._accelerator)
            if norm is not None:
                values["grad_norm"] = norm
        self._grad_norm = None
        monitor.log(values, step=step, **counts)

    def finish(self) -> None:
        """Called by `accelerator.end_training()`."""
        self.close()
