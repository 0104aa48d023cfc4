"""Per-step entries drained in batches: tensors read once per drain, window aggregates, record lines.

The training thread only appends entries (see monitor.py); everything here runs on the
background thread (or, rarely, on the training thread when the buffer is full), under one lock.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import tensors
from .tensors import Stack

log = logging.getLogger("trainer_hook")

#: Upper bounds (seconds) of training_step_duration_seconds; +Inf is implicit.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0)
WINDOW_MAX_KEYS = ("loss", "grad_norm")
#: Keys whose non-finite value on a step the GradScaler skipped is the overflow itself, not a fault.
OVERFLOW_KEYS = ("grad_norm",)


class Entry(NamedTuple):
    """One log() call as the training thread saw it; values may still be device tensors."""

    time: float
    duration: float | None
    step: Any  # int, a 0-d tensor (read here), or None: the previous step + 1
    batch_id: Any
    samples: Any
    tokens: Any
    values: dict[str, Any]
    data_wait: float = 0.0  # seconds waited for this step's batch
    skipped: int = 0  # optimizer steps the GradScaler skipped (overflow) since the previous entry
    loss_scale: Any = None  # the GradScaler's scale after this step (a tensor copy), if watched
    stacks: tuple[Stack, ...] = ()  # the values' tensors, copied on their device (see tensors.py)
    events: tuple[tuple[Any, Any], ...] = ()  # (device, CUDA event) marking those copies ready


class ProcessIdentity(NamedTuple):
    """The pushing process (training_local_rank, training_world_size, training_process_info)."""

    local_rank: int = 0
    world_size: int = 1
    pid: int = 0
    hostname: str = ""


@dataclass
class Snapshot:
    """The state published once per push interval (what both push and pull expose).

    A published snapshot is never changed (pull mode may be serving it): derive a new one with
    dataclasses.replace or merge_maxima.
    """

    gauges: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    max_steps: dict[str, int] = field(default_factory=dict)  # step at which each maximum was seen
    value_sums: dict[str, float] = field(default_factory=dict)  # finite values only
    value_counts: dict[str, int] = field(default_factory=dict)
    nonfinite_values: dict[str, int] = field(default_factory=dict)
    step: int = -1
    steps_total: int = 0
    samples_total: float = 0.0
    tokens_total: float | None = None
    bucket_counts: tuple[int, ...] = (0,) * (len(STEP_BUCKETS) + 1)
    duration_sum: float = 0.0
    nonfinite_steps_total: int = 0
    first_nonfinite_step: int = -1  # of the current (or latest) streak of non-finite steps
    first_nonfinite_batch_id: float = -1
    last_nonfinite_step: int = -1
    last_nonfinite_batch_id: float = -1
    skipped_steps_total: int = 0
    last_update: float = 0.0
    dropped: dict[str, int] = field(default_factory=dict)
    # Filled in by the monitor when it publishes:
    data_wait_seconds: float = 0.0
    state: str = "running"
    failure_reason: str = ""  # a failed run's end: the exception's class name (or "SIGTERM")
    start_time: float = 0.0
    push_failures: int = 0
    record_failures: int = 0
    run_labels: dict[str, str] = field(default_factory=dict)
    gpus: tuple[tuple[str, str], ...] = ()
    cuda: dict[str, float] | None = None
    process: ProcessIdentity = ProcessIdentity()


def json_number(value: float | None) -> float | str | None:
    """JSON has no NaN/Infinity: non-finite values are written as "nan", "inf", "-inf"."""
    return value if value is None or math.isfinite(value) else str(value)


def _numeric_id(batch_id: Any) -> float:
    try:
        return float(batch_id)
    except (TypeError, ValueError, OverflowError):
        return -1.0


class Aggregator:
    """Turns drained entries into record lines and running state; publishes snapshots."""

    def __init__(self, names: dict[Any, Any], max_hold: float) -> None:
        self._names = names  # log key -> metric suffix, filled by the training thread
        self._max_hold = max_hold
        self._recent: deque[tuple[float, dict[str, tuple[float, int]]]] = deque()  # (published at, window maxima)
        self._lock = threading.RLock()  # close() may run in a signal handler
        self._state = Snapshot()
        self._counts = [0] * (len(STEP_BUCKETS) + 1)
        self._window: dict[str, tuple[float, int]] = {}  # name -> (maximum, its step)
        self._warned_nonfinite = False
        self._in_streak = False  # the previous step had a non-finite value

    def drain(self, entries: list[Entry]) -> list[dict[str, Any]]:
        """Read the entries' tensors (one transfer per device and dtype) and fold them in.

        Returns one record line (a JSON-ready dict) per entry, in order.
        """
        with self._lock:
            rows = [(e.values, {"samples": e.samples, "tokens": e.tokens, "batch_id": e.batch_id,
                                "step": e.step, "loss_scale": e.loss_scale}) for e in entries]
            tensors.read(tensors.tensor_slots(m for row in rows for m in row),
                         [(e.values, stack) for e in entries for stack in e.stacks],
                         [event for e in entries for event in e.events], self._state.dropped)
            return [self._fold(entry, values, extra) for entry, (values, extra) in zip(entries, rows)]

    def _fold(self, entry: Entry, values: dict[Any, float], extra: dict[str, Any]) -> dict[str, Any]:
        state = self._state
        samples, tokens, batch_id = extra.get("samples"), extra.get("tokens"), extra.get("batch_id")
        state.step = step = self._resolve_step(extra.get("step"))
        nonfinite = []
        for key, value in values.items():
            name = self._names[key]
            if math.isfinite(value):
                state.value_sums[name] = state.value_sums.get(name, 0.0) + value
                state.value_counts[name] = state.value_counts.get(name, 0) + 1
            elif entry.skipped and name in OVERFLOW_KEYS:
                continue  # the GradScaler skipped this step: an overflow, not a divergence
            else:
                nonfinite.append(key)
                state.nonfinite_values[name] = state.nonfinite_values.get(name, 0) + 1
            state.gauges[name] = value
            if name in WINDOW_MAX_KEYS and not math.isnan(value):
                _raise_max(self._window, name, value, step)
        loss_scale = extra.get("loss_scale")
        if loss_scale is not None:
            state.gauges["loss_scale"] = loss_scale
        state.steps_total += 1
        state.skipped_steps_total += entry.skipped
        state.last_update = entry.time
        if samples is not None and math.isfinite(samples):
            state.samples_total += samples
        if tokens is not None and math.isfinite(tokens):
            state.tokens_total = (state.tokens_total or 0.0) + tokens
        if entry.duration is not None:
            self._counts[bisect.bisect_left(STEP_BUCKETS, entry.duration)] += 1
            state.duration_sum += entry.duration
        line: dict[str, Any] = {"time": round(entry.time, 6), "step": step,
                                "batch_id": batch_id, "samples": json_number(samples),
                                "tokens": json_number(tokens),
                                "duration_seconds": None if entry.duration is None else round(entry.duration, 9),
                                "data_wait_seconds": round(entry.data_wait, 9),
                                "values": {str(k): json_number(v) for k, v in values.items()}}
        if entry.skipped:
            line["skipped"] = "overflow"
        if loss_scale is not None:
            line["loss_scale"] = json_number(loss_scale)
        if nonfinite:
            if not self._in_streak:
                state.first_nonfinite_step = step
                state.first_nonfinite_batch_id = _numeric_id(batch_id)
            self._in_streak = True
            state.nonfinite_steps_total += 1
            state.last_nonfinite_step = step
            state.last_nonfinite_batch_id = _numeric_id(batch_id)
            line["nonfinite"] = [str(key) for key in nonfinite]
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                shown = ", ".join(f"{k}={values[k]}" for k in nonfinite)
                log.warning("first non-finite value at step %s (batch_id %r): %s", step, batch_id, shown)
        elif not entry.skipped:
            self._in_streak = False
        return line

    def _resolve_step(self, step: Any) -> int:
        if step is None:
            return self._state.step + 1
        if type(step) is int:
            return step
        if not math.isfinite(step):  # a NaN or infinite step tensor
            self._state.dropped["not_numeric"] = self._state.dropped.get("not_numeric", 0) + 1
            return self._state.step + 1
        return int(step)

    def publish(self, dropped: dict[str, int], **extra: Any) -> Snapshot:
        """A copy of the state; starts a new window for the *_max series.

        `dropped`: the caller's drop counts by reason, to which the drain's own are added.

        The published maxima cover the windows published in the last `max_hold` seconds, so a
        one-step spike stays visible long enough for a Prometheus scrape (15 s by default) however
        short the push interval; the latest window with steps is always included.
        """
        with self._lock:
            state = self._state
            now = time.monotonic()
            if self._window:
                self._recent.append((now, self._window))
                self._window = {}
            while len(self._recent) > 1 and self._recent[0][0] < now - self._max_hold:
                self._recent.popleft()
            maxima: dict[str, tuple[float, int]] = {}
            for _, window in self._recent:
                for name, (value, step) in window.items():
                    _raise_max(maxima, name, value, step)
            copies = {name: dict(value) for name, value in state.__dict__.items() if isinstance(value, dict)}
            return Snapshot(**{**state.__dict__, **copies,
                               "maxima": {name: value for name, (value, _) in maxima.items()},
                               "max_steps": {name: step for name, (_, step) in maxima.items()},
                               "dropped": {r: n + state.dropped.get(r, 0) for r, n in dropped.items()},
                               "bucket_counts": tuple(itertools.accumulate(self._counts)), **extra})


def merge_maxima(older: Snapshot, newer: Snapshot) -> Snapshot:
    """`newer` with the maxima of `older` (one that never reached the Pushgateway) carried in.

    Returns a new snapshot; neither argument is changed.
    """
    maxima = {name: (value, newer.max_steps.get(name, -1)) for name, value in newer.maxima.items()}
    for name, value in older.maxima.items():
        _raise_max(maxima, name, value, older.max_steps.get(name, -1))
    return dataclasses.replace(newer, maxima={name: value for name, (value, _) in maxima.items()},
                               max_steps={name: step for name, (_, step) in maxima.items()})


def _raise_max(maxima: dict[str, tuple[float, int]], name: str, value: float, step: int) -> None:
    """Keep the larger value and its step (the earlier step on a tie)."""
    if name not in maxima or value > maxima[name][0]:
        maxima[name] = (value, step)
