"""One pass over a run's record lines -> bounded, plottable series and the facts of a post-mortem.

Long runs are downsampled to at most MAX_BUCKETS buckets per series, each keeping its minimum and
its maximum point, so a one-step spike survives whatever the run's length.
"""
from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from trainer_hook.contract import START_PROCESS_KEYS

from .records import Run, number

MAX_BUCKETS = 1500
#: Panels from the record: title -> unit. The logged keys are mapped as the live hook maps them.
RECORD_PANELS = {"loss": "", "grad_norm": "", "learning_rate": "", "data_wait_share": "ratio",
                 "step_time_seconds": "s"}


class MinMaxSeries:
    """(x, y) points reduced to per-bucket minimum and maximum; memory O(MAX_BUCKETS)."""

    def __init__(self, max_buckets: int = MAX_BUCKETS) -> None:
        self.max_buckets = max_buckets
        self.width = 1
        self.buckets: list[list[float]] = []  # [count, x_at_min, min, x_at_max, max]

    def add(self, x: float, y: float) -> None:
        buckets = self.buckets
        if buckets and buckets[-1][0] < self.width:
            bucket = buckets[-1]
            bucket[0] += 1
            if y < bucket[2]:
                bucket[1], bucket[2] = x, y
            if y > bucket[4]:
                bucket[3], bucket[4] = x, y
            return
        buckets.append([1, x, y, x, y])
        if len(buckets) > self.max_buckets:
            self.buckets = [_merge(buckets[i], buckets[i + 1]) if i + 1 < len(buckets) else buckets[i]
                            for i in range(0, len(buckets), 2)]
            self.width *= 2

    def points(self) -> tuple[list[float], list[float]]:
        """The kept points in x order (a bucket's minimum and maximum, once each)."""
        xs: list[float] = []
        ys: list[float] = []
        for _, x_min, y_min, x_max, y_max in self.buckets:
            pairs = sorted({(x_min, y_min), (x_max, y_max)})
            for x, y in pairs:
                xs.append(x)
                ys.append(y)
        return xs, ys

    def __len__(self) -> int:
        return len(self.buckets)


def _merge(a: list[float], b: list[float]) -> list[float]:
    low = (a[1], a[2]) if a[2] <= b[2] else (b[1], b[2])
    high = (a[3], a[4]) if a[4] >= b[4] else (b[3], b[4])
    return [a[0] + b[0], low[0], low[1], high[0], high[1]]


@dataclass
class RunSummary:
    """What the report shows of one run (one rank)."""

    run: Run
    series: dict[str, MinMaxSeries] = field(default_factory=lambda: {k: MinMaxSeries() for k in RECORD_PANELS})
    clock: MinMaxSeries = field(default_factory=MinMaxSeries)  # step -> unix time
    first_time: float | None = None
    first_step: int | None = None
    last_time: float | None = None
    last_step: int | None = None
    first_nonfinite: tuple[int, Any, list[str]] | None = None  # (step, batch_id, keys)
    nonfinite_steps: int = 0
    skipped_steps: int = 0

    def add(self, line: dict[str, Any], suffix) -> None:
        """Fold one step line in; `suffix(key)` maps a logged key to its exported name."""
        step, time = line["step"], line["time"]
        if self.first_time is None:
            self.first_time, self.first_step = time, step
        self.last_time, self.last_step = time, step
        self.clock.add(step, time)
        bad = line["nonfinite"]
        for key, value in line["values"].items():
            name = suffix(key)
            if name is not None and name in self.series and math.isfinite(value):
                self.series[name].add(step, value)
        if bad:
            self.nonfinite_steps += 1
            if self.first_nonfinite is None:
                self.first_nonfinite = (step, line.get("batch_id"), bad)
        if line.get("skipped"):
            self.skipped_steps += 1
        duration = number(line.get("duration_seconds"))
        if duration is not None and math.isfinite(duration) and duration > 0:
            self.series["step_time_seconds"].add(step, duration)
            wait = number(line.get("data_wait_seconds"))
            if wait is not None and math.isfinite(wait):
                self.series["data_wait_share"].add(step, min(1.0, max(0.0, wait / duration)))

    def step_at(self, times: list[float]) -> list[float]:
        """Unix times -> (fractional) steps of this run, by interpolation on its clock."""
        import numpy
        steps, clock = self.clock.points()
        if not steps:
            return [math.nan] * len(times)
        return list(numpy.interp(times, clock, steps))

    def facts(self) -> dict[str, str]:
        """Config and state for the report's table."""
        run, end = self.run, self.run.end
        facts = {"job": run.job, "run": run.run, "rank": run.rank, "instance": run.instance,
                 "record format": str(run.format), "steps in record": str(run.steps)}
        for key in START_PROCESS_KEYS:
            if key in run.start:
                facts[key.replace("_", " ")] = str(run.start[key])
        if self.first_time is not None:
            facts["first step"] = f"{self.first_step} at {utc(self.first_time)}"
            facts["last step"] = f"{self.last_step} at {utc(self.last_time)}"
        if end is None:
            facts["state"] = _without_end_line(run)
        else:
            facts["state"] = str(end.get("state", "?"))
            if end.get("reason"):
                facts["exception"] = str(end["reason"]) + (f": {end['message']}" if end.get("message") else "")
            facts["ended"] = utc(float(end["time"]))
        if self.first_nonfinite is not None:
            step, batch, keys = self.first_nonfinite
            facts["first non-finite step"] = f"{step} (batch {batch}; {', '.join(keys)})"
            facts["non-finite steps"] = str(self.nonfinite_steps)
        if self.skipped_steps:
            facts["skipped steps (loss-scale overflow)"] = str(self.skipped_steps)
        return facts


def _without_end_line(run: Run) -> str:
    """The state of a rank whose record has no end line: live, dead, or (another host's) unknown."""
    died = "the process died without closing (SIGKILL, power, OOM killer)"
    pid = run.start.get("pid")
    if not isinstance(pid, int) or run.instance != socket.gethostname():
        return f"no end line: still running, or {died}"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"no end line: {died}"
    except PermissionError:  # another user's process: alive
        pass
    return f"running (no end line yet; its process {pid} is alive on this host)"


def utc(timestamp: float) -> str:
    """A unix time as 'YYYY-mm-dd HH:MM:SS UTC'."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp))
