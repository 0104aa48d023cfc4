"""Record lines -> OpenMetrics samples with the live series' names and labels, one step at a time.

Each step line becomes the samples a scrape of the Pushgateway would have shown right after that
step, stamped with the step's own time: per-step series (training_step, the logged values, the
counters) at every step; slowly changing ones (state, info, start time, histogram, non-finite
markers) when they change and at least every REFRESH_SECONDS of record time, so that PromQL's
5-minute lookback always finds them. Every series carries REPLAY_LABEL.
"""
from __future__ import annotations

import bisect
import math
from typing import Any

from trainer_hook.aggregate import STEP_BUCKETS, WINDOW_MAX_KEYS
from trainer_hook.exposition import RUN_STATES
from trainer_hook.values import PREFIX, label_name, label_value

from .records import Run, exported_name, number

#: The label that marks replayed series (live series never carry it).
REPLAY_LABEL = "replayed"
REPLAY_VALUE = "true"
#: Slow series are repeated at least this often (record time): a default scrape interval.
REFRESH_SECONDS = 15.0
_BOUNDS = [repr(b) for b in STEP_BUCKETS] + ["+Inf"]


def escape(value: str) -> str:
    """A label value in OpenMetrics text."""
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def labels_text(labels: dict[str, str]) -> str:
    return ",".join(f'{name}="{escape(value)}"' for name, value in labels.items())


def fmt(value: float) -> str:
    """OpenMetrics number: NaN, +Inf, -Inf spelled as the format wants."""
    if value != value:
        return "NaN"
    if value in (math.inf, -math.inf):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class RunSeries:
    """The OpenMetrics state of one replayed run (one rank): counters, markers, last timestamp."""

    def __init__(self, run: Run) -> None:
        self.run = run
        base = {"job": run.job, "run": run.run, "rank": run.rank, "instance": run.instance,
                REPLAY_LABEL: REPLAY_VALUE}
        self.labels = labels_text(base)
        config = {}
        for key, value in run.config.items():
            name = label_name(key)
            config["config_" + name if name in base else name] = label_value(value)
        self.info_labels = labels_text({**base, **config})
        self.samples = 0
        self._last_ms = -1
        self._last = (-math.inf, 0)  # (time, step) of the last step line
        self._steps = 0
        self._samples_total = 0.0
        self._tokens_total: float | None = None
        self._data_wait: float | None = None
        self._sums: dict[str, list[float]] = {}  # suffix -> [sum, count] of finite values
        self._nonfinite_values: dict[str, int] = {}
        self._nonfinite_steps = 0
        self._skipped = 0
        self._markers = {"first_nonfinite_step": -1.0, "first_nonfinite_batch_id": -1.0,
                         "last_nonfinite_step": -1.0, "last_nonfinite_batch_id": -1.0}
        self._in_streak = False
        self._buckets = [0] * (len(STEP_BUCKETS) + 1)
        self._duration_sum = 0.0
        self._last_update = 0.0
        self._refreshed = -math.inf

    def _stamp(self, time: float) -> str:
        """' <seconds>\\n' for a sample at `time`, at least 1 ms after the previous one.

        TSDB timestamps are milliseconds and one series cannot hold two samples at the same one:
        steps logged less than 1 ms apart are moved forward by the missing milliseconds.
        """
        ms = max(int(round(time * 1000)), self._last_ms + 1)
        self._last_ms = ms
        seconds, millis = divmod(ms, 1000)
        return f" {seconds}.{millis:03d}\n"

    def in_order(self, line: dict[str, Any]) -> bool:
        """False for a line not after the run's previous one (a copy of a record read twice).

        Steps logged at the same time are in order when their step numbers grow.
        """
        here = (line["time"], line["step"])
        if here <= self._last:
            return False
        self._last = here
        return True

    def step(self, line: dict[str, Any]) -> str:
        """The samples of one step line (call in_order() first)."""
        ts = self._stamp(line["time"])
        labels = self.labels
        out = [f"training_step{{{labels}}} {line['step']}{ts}"]
        flagged = line["nonfinite"]
        for key, value in line["values"].items():
            name = exported_name(key)
            if name is None:
                continue
            if math.isfinite(value):
                totals = self._sums.setdefault(name, [0.0, 0])
                totals[0] += value
                totals[1] += 1
            elif key in flagged:
                self._nonfinite_values[name] = self._nonfinite_values.get(name, 0) + 1
            else:
                continue  # an overflow on a skipped step: the live gauge keeps its previous value
            out.append(f"{PREFIX}{name}{{{labels}}} {fmt(value)}{ts}")
            if name in WINDOW_MAX_KEYS and not math.isnan(value):
                out.append(f"{PREFIX}{name}_max{{{labels}}} {fmt(value)}{ts}")
        self._steps += 1
        out.append(f"training_steps_total{{{labels}}} {self._steps}{ts}")
        samples, tokens = number(line.get("samples")), number(line.get("tokens"))
        if samples is not None and math.isfinite(samples):
            self._samples_total += samples
        out.append(f"training_samples_total{{{labels}}} {fmt(self._samples_total)}{ts}")
        if tokens is not None and math.isfinite(tokens):
            self._tokens_total = (self._tokens_total or 0.0) + tokens
        if self._tokens_total is not None:
            out.append(f"training_tokens_total{{{labels}}} {fmt(self._tokens_total)}{ts}")
        wait = number(line.get("data_wait_seconds"))
        if wait is not None and math.isfinite(wait):
            self._data_wait = (self._data_wait or 0.0) + wait
        if self._data_wait is not None:
            out.append(f"training_data_wait_seconds_total{{{labels}}} {fmt(self._data_wait)}{ts}")
        for name, (total, count) in self._sums.items():
            out.append(f'training_logged_value_sum{{{labels},key="{name}"}} {fmt(total)}{ts}')
            out.append(f'training_logged_value_count{{{labels},key="{name}"}} {count}{ts}')
        for name, count in self._nonfinite_values.items():
            out.append(f'training_nonfinite_values_total{{{labels},key="{name}"}} {count}{ts}')
        changed = self._note_nonfinite(line, bool(flagged))
        out.append(f"training_nonfinite_steps_total{{{labels}}} {self._nonfinite_steps}{ts}")
        if line.get("skipped") == "overflow":
            self._skipped += 1
        if self._skipped:
            out.append(f'training_skipped_steps_total{{{labels},reason="overflow"}} {self._skipped}{ts}')
        scale = number(line.get("loss_scale"))
        if scale is not None:
            out.append(f"training_loss_scale{{{labels}}} {fmt(scale)}{ts}")
        cuda = line.get("cuda")
        if isinstance(cuda, dict):
            for field, name in (("allocated", "allocated"), ("reserved", "reserved")):
                value = number(cuda.get(field))
                if value is not None:
                    out.append(f"training_cuda_memory_{name}_bytes{{{labels}}} {fmt(value)}{ts}")
        duration = number(line.get("duration_seconds"))
        if duration is not None and math.isfinite(duration):
            self._buckets[bisect.bisect_left(STEP_BUCKETS, duration)] += 1
            self._duration_sum += duration
        self._last_update = line["time"]
        if changed or line["time"] - self._refreshed >= REFRESH_SECONDS:
            self._refreshed = line["time"]
            out.extend(self._slow("running", ts))
        self.samples += len(out)
        return "".join(out)

    def end(self, line: dict[str, Any]) -> str:
        """The samples of the end line: the final state, and everything slow once more."""
        state = line.get("state") if line.get("state") in RUN_STATES else "failed"
        ts = self._stamp(float(line["time"]))
        out = self._slow(state, ts)
        if state == "failed" and isinstance(line.get("reason"), str) and line["reason"]:
            # What the live hook pushes: the class of the exception that ended the run.
            out.append(f'training_run_failure_info{{{self.labels},reason="{escape(line["reason"])}"}} 1{ts}')
        self.samples += len(out)
        return "".join(out)

    def _note_nonfinite(self, line: dict[str, Any], nonfinite: bool) -> bool:
        """Update the non-finite markers; True when they changed at this step."""
        if nonfinite:
            self._nonfinite_steps += 1
            batch = number(line.get("batch_id"))
            batch = -1.0 if batch is None else batch
            markers = self._markers
            markers["last_nonfinite_step"], markers["last_nonfinite_batch_id"] = line["step"], batch
            if not self._in_streak:
                markers["first_nonfinite_step"], markers["first_nonfinite_batch_id"] = line["step"], batch
            self._in_streak = True
        elif not line.get("skipped"):  # a skipped step neither starts nor ends a streak
            self._in_streak = False
        return nonfinite

    def _slow(self, state: str, ts: str) -> list[str]:
        labels, start = self.labels, self.run.start
        out = [f"training_run_state{{{labels},state=\"{name}\"}} {int(name == state)}{ts}"
               for name in RUN_STATES]
        out.append(f"training_run_info{{{self.info_labels}}} 1{ts}")
        if self.run.start_time is not None:
            out.append(f"training_start_timestamp_seconds{{{labels}}} {fmt(self.run.start_time)}{ts}")
        out.append(f"training_last_update_timestamp_seconds{{{labels}}} {fmt(self._last_update)}{ts}")
        for key in ("world_size", "local_rank"):
            value = number(start.get(key))
            if value is not None:
                out.append(f"training_{key}{{{labels}}} {fmt(value)}{ts}")
        for name, value in self._markers.items():
            out.append(f"training_{name}{{{labels}}} {fmt(value)}{ts}")
        cumulative = 0
        for bound, count in zip(_BOUNDS, self._buckets):
            cumulative += count
            out.append(f'training_step_duration_seconds_bucket{{{labels},le="{bound}"}} {cumulative}{ts}')
        out.append(f"training_step_duration_seconds_count{{{labels}}} {cumulative}{ts}")
        out.append(f"training_step_duration_seconds_sum{{{labels}}} {fmt(self._duration_sum)}{ts}")
        return out
