"""What the framework integrations share: optional imports, a deferred monitor, the data-wait clock."""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from types import FrameType, ModuleType
from typing import Any

from .._torch import TENSOR_TYPES
from ..monitor import TrainingMonitor
from ..settings import ENV_JOB

log = logging.getLogger("trainer_hook")


def require(integration: str, extra: str, *modules: str) -> ModuleType:
    """The first of `modules` that imports, or an ImportError naming the extra to install."""
    for name in modules:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"trainer_hook.integrations.{integration} needs {' or '.join(modules)}: "
                      f"pip install 'dualtrack[{extra}]'")


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the first tensor in a batch (tensor, mapping or sequence); no sync."""
    if isinstance(batch, TENSOR_TYPES):
        return int(batch.shape[0]) if batch.dim() else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = batch_size(item)
        if size is not None:
            return size
    return None


def calling_instance(cls: type) -> Any:
    """The nearest `self` up the call stack that is a `cls` (a framework calling its callbacks
    passes no reference to itself), or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, cls):
            return candidate
        frame = frame.f_back
    return None


def engine_grad_norm(accelerator: Any) -> Any:
    """The global grad norm DeepSpeed's engine computed over all partitions in its last step
    (`get_global_grad_norm()`), or None: no DeepSpeed engine behind this Accelerator, or no norm yet.

    Accelerate's own `clip_grad_norm_` returns None under DeepSpeed in older versions, and nothing
    else on a rank sees the whole gradients under ZeRO.
    """
    engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    get_norm = getattr(engine, "get_global_grad_norm", None)
    return get_norm() if callable(get_norm) else None


class DeferredMonitor:
    """A TrainingMonitor's arguments now, the monitor once the framework knows the rank and config.

    The arguments are those of TrainingMonitor (checked here: a wrong name raises TypeError at once);
    `rank_zero_only=True` creates the monitor on global rank 0 only.
    """

    def __init__(self, *args: Any, rank_zero_only: bool = False, **kwargs: Any) -> None:
        self._arguments = inspect.signature(TrainingMonitor).bind(*args, **kwargs).arguments
        self.rank_zero_only = rank_zero_only
        self.monitor: TrainingMonitor | None = None
        self._batch_end: float | None = None
        self._warned: set[str] = set()
        self._patched: list[tuple[Any, str]] = []
        self._pause: Any = None  # the monitor.paused() under way, entered from a framework's hook

    def open(self, rank: int, config: Mapping[str, Any] | None = None,
             job: str = "training") -> TrainingMonitor | None:
        """Create the monitor (once) for `rank`, with the framework's `config` under the user's.

        `job`: the framework's name for the run, used when neither `job=` nor $DUALTRACK_JOB is set.
        """
        if self.monitor is None and not (self.rank_zero_only and rank != 0):
            arguments = dict(self._arguments)
            arguments.setdefault("rank", rank)
            if arguments.get("job") is None and not os.environ.get(ENV_JOB):
                arguments["job"] = job
            mine = arguments.get("config")
            if mine is not None and not isinstance(mine, Mapping):
                mine = vars(mine)
            arguments["config"] = {**(config or {}), **(mine or {})}
            self.monitor = TrainingMonitor(**arguments)
        return self.monitor

    def watch_scaler(self, scaler: Any) -> None:
        """Count the steps the framework's GradScaler (None: no fp16) skips, and export its scale,
        as `TrainingMonitor.watch(scaler=)` does: on its own found_inf, which also covers fused
        optimizers, whose overflows Accelerate's `optimizer_step_was_skipped` misses."""
        if scaler is not None and self.monitor is not None:
            self.monitor.watch(scaler=scaler)

    def log_step(self, step: int, epoch: Any, loss: Any, grad_norm: Any, learning_rate: Any,
                 **counts: Any) -> None:
        """One optimizer step to the monitor; values the framework did not give are left out."""
        if self.monitor is None:  # not started (rank_zero_only on another rank)
            return
        values = {"epoch": epoch}
        for key, value in (("loss", loss), ("grad_norm", grad_norm), ("learning_rate", learning_rate)):
            if value is not None:
                values[key] = value
        self.monitor.log(values, step=step, **counts)

    def close(self, failed: bool = False, reason: str | None = None) -> None:
        """Close the monitor and remove the wrappers patch() installed; a later open() (another
        `fit`/`train` with the same callback) starts a new monitor."""
        self.resume()
        for owner, name in reversed(self._patched):
            vars(owner).pop(name, None)
        self._patched = []
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            monitor.close(failed=failed, reason=reason)

    def pause(self, reason: str) -> None:
        """Enter monitor.paused(reason) until resume(): the framework's evaluation or save, seen from
        the hooks it calls before and after (nothing if a pause is already under way)."""
        if self.monitor is not None and self._pause is None:
            self._pause = self.monitor.paused(reason)
            self._pause.__enter__()

    def resume(self) -> None:
        """End the pause pause() entered, if any."""
        pause, self._pause = self._pause, None
        if pause is not None:
            pause.__exit__(None, None, None)

    def paused_during(self, reason: str) -> Callable[[Callable], Callable]:
        """A patch() wrapper running the method inside monitor.paused(reason) (e.g. a checkpoint save)."""
        def wrap(method: Callable) -> Callable:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                if self.monitor is None:
                    return method(*args, **kwargs)
                with self.monitor.paused(reason):
                    return method(*args, **kwargs)
            return wrapped
        return wrap

    def patch(self, owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
        """Wrap the method `name` of this one framework object (not its class) until close()."""
        if name not in vars(owner):
            setattr(owner, name, wrap(getattr(owner, name)))
            self._patched.append((owner, name))

    def capture_result(self, attribute: str) -> Callable[[Callable], Callable]:
        """A patch() wrapper storing the method's return value (e.g. a grad norm) in `attribute`."""
        def wrap(method: Callable) -> Callable:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                result = method(*args, **kwargs)
                setattr(self, attribute, result)
                return result
            return wrapped
        return wrap

    def batch_ended(self) -> None:
        """The framework is done with a batch (or with an evaluation/checkpoint in between)."""
        self._batch_end = time.perf_counter()

    def batch_started(self) -> float | None:
        """Seconds since batch_ended(): the time the loop waited for this batch."""
        if self._batch_end is None:
            return None
        waited, self._batch_end = time.perf_counter() - self._batch_end, None
        return waited

    def warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)
