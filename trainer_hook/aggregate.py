"""Per-step entries drained in batches: tensors read once per drain, window aggregates, record lines.

The training thread only appends entries (see monitor.py); everything here runs on the
background thread (or, rarely, on the training thread when the buffer is full), under one lock.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

from . import tensors
from .contract import SKIP_REASON, Accumulator, Snapshot, Window, json_number, raise_max, record_id
from .flops import ModelFlops
from .tensors import Stack

log = logging.getLogger("trainer_hook")


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
    skipped: Any = 0  # optimizer steps the GradScaler skipped (overflow) since the previous entry:
    # an int, or a tensor (read here) where a fused optimizer skipped inside its step
    loss_scale: Any = None  # the GradScaler's scale after this step (a tensor copy), if watched
    stacks: Sequence[Stack] = ()  # the values' tensors, copied on their device (see tensors.py)
    events: tuple[tuple[Any, Any], ...] = ()  # (device, CUDA event) marking those copies ready


class Aggregator:
    """Turns drained entries into record lines and running state; publishes snapshots."""

    def __init__(self, names: dict[Any, Any], max_hold: float, flops: ModelFlops) -> None:
        self._names = names  # log key -> metric suffix, filled by the training thread
        self._flops = flops  # the run's model FLOPs per token or sample (the monitor sets them)
        self._max_hold = max_hold
        self._recent: deque[tuple[float, Window]] = deque()  # (published at, window maxima)
        self._lock = threading.RLock()  # close() may run in a signal handler
        self._run = Accumulator()
        self._state = self._run.state
        self._warned_nonfinite = False

    def drain(self, entries: list[Entry]) -> list[dict[str, Any]]:
        """Read the entries' tensors (one transfer per device and dtype) and fold them in.

        Returns one record line (a JSON-ready dict) per entry, in order.
        """
        with self._lock:
            rows = [(e.values, {"samples": e.samples, "tokens": e.tokens, "batch_id": e.batch_id,
                                "step": e.step, "loss_scale": e.loss_scale, "skipped": e.skipped})
                    for e in entries]
            tensors.read(tensors.tensor_slots(m for row in rows for m in row),
                         [(e.values, stack) for e in entries for stack in e.stacks],
                         [event for e in entries for event in e.events], self._state.dropped)
            return [self._fold(entry, values, extra) for entry, (values, extra) in zip(entries, rows)]

    def _fold(self, entry: Entry, values: dict[Any, float], extra: dict[str, Any]) -> dict[str, Any]:
        samples, tokens, batch_id = extra.get("samples"), extra.get("tokens"), record_id(extra.get("batch_id"))
        step = self._resolve_step(extra.get("step"))
        loss_scale = extra.get("loss_scale")
        skipped = round(extra.get("skipped", 0))  # an unreadable tensor is dropped (and counted)
        flops = self._flops.of(tokens, samples)
        nonfinite = self._run.fold(step, values, self._names.__getitem__, time=entry.time,
                                   batch_id=batch_id, samples=samples, tokens=tokens,
                                   duration=entry.duration, skipped=skipped,
                                   loss_scale=loss_scale, flops=flops).nonfinite
        line: dict[str, Any] = {"time": round(entry.time, 6), "step": step,
                                "batch_id": batch_id, "samples": json_number(samples),
                                "tokens": json_number(tokens),
                                "duration_seconds": None if entry.duration is None else round(entry.duration, 9),
                                "data_wait_seconds": round(entry.data_wait, 9),
                                "values": {str(k): json_number(v) for k, v in values.items()}}
        if skipped:
            line["skipped"] = SKIP_REASON
        if loss_scale is not None:
            line["loss_scale"] = json_number(loss_scale)
        if flops is not None:
            line["flops"] = json_number(flops)
        if nonfinite:
            line["nonfinite"] = [str(key) for key in nonfinite]
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                shown = ", ".join(f"{k}={values[k]}" for k in nonfinite)
                log.warning("first non-finite value at step %s (batch_id %r): %s", step, batch_id, shown)
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
        short the push interval; the latest window with a finite value is always included (a window
        whose values were all NaN/Inf leaves the previous maxima in place).
        """
        with self._lock:
            state = self._state
            now = time.monotonic()
            window = self._run.take_window()
            if window:
                self._recent.append((now, window))
            while len(self._recent) > 1 and self._recent[0][0] < now - self._max_hold:
                self._recent.popleft()
            maxima: Window = {}
            for _, held in self._recent:
                for name, (value, step) in held.items():
                    raise_max(maxima, name, value, step)
            copies = {name: dict(value) for name, value in state.__dict__.items() if isinstance(value, dict)}
            return Snapshot(**{**state.__dict__, **copies,
                               "maxima": {name: value for name, (value, _) in maxima.items()},
                               "max_steps": {name: step for name, (_, step) in maxima.items()},
                               "dropped": {r: n + state.dropped.get(r, 0) for r, n in dropped.items()},
                               "bucket_counts": self._run.cumulative_buckets(), **extra})
