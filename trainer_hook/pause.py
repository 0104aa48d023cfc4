"""Pauses that are not hangs: the time a rank spends inside `monitor.paused(reason)` (a checkpoint, an
evaluation), by reason. The training thread begins and ends pauses; the background thread reads them
when it publishes (training_paused_seconds_total{reason}, training_pause_start_timestamp_seconds{reason})."""
from __future__ import annotations

import threading
import time
from typing import Any


class Pauses:
    """The current pause (at most one: a pause inside a pause belongs to the outer one) and the
    seconds paused so far by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: tuple[str, float, float] | None = None  # reason, Unix time, perf_counter
        self._totals: dict[str, float] = {}

    @property
    def reason(self) -> str | None:
        """The current pause's reason; None when not paused."""
        current = self._current
        return None if current is None else current[0]

    def begin(self, reason: str) -> bool:
        """Start a pause; False (and nothing changes) when one is already under way."""
        with self._lock:
            if self._current is not None:
                return False
            self._current = (reason, time.time(), time.perf_counter())
            self._totals.setdefault(reason, 0.0)
            return True

    def end(self) -> dict[str, Any] | None:
        """End the current pause: its record line ({"event": "pause", ...}), None if none was under way."""
        with self._lock:
            if self._current is None:
                return None
            reason, start, began = self._current
            seconds = max(0.0, time.perf_counter() - began)
            self._totals[reason] += seconds
            self._current = None
        return {"event": "pause", "reason": reason, "time": start, "seconds": round(seconds, 6)}

    def state(self) -> tuple[dict[str, float], tuple[str, float] | None]:
        """Seconds paused by reason (the current pause's so far included) and the current pause
        (reason, Unix time it began), None when not paused."""
        with self._lock:
            totals = dict(self._totals)
            if self._current is None:
                return totals, None
            reason, start, began = self._current
            totals[reason] += max(0.0, time.perf_counter() - began)
            return totals, (reason, start)
