"""Record lines -> OpenMetrics samples with the live series' names and labels, one step at a time.

Each step line is folded into the exported state by the live hook's own aggregation
(trainer_hook.contract.Accumulator) and becomes the samples a scrape of the Pushgateway would have
shown right after that step, stamped with the step's own time: per-step series (training_step, the
counters) at every step; a logged key's series (training_<key>, its sum, count and non-finite count)
at the steps that log it; slowly changing ones (state, info, start time, histogram, non-finite
markers) when they change and at least every REFRESH_SECONDS of record time, so that PromQL's
5-minute lookback always finds them. Every series carries REPLAY_LABEL.

So a step's samples are a fixed number plus a few per key the step line holds: the output grows
linearly with the record (the labels are at most MAX_LABEL_LENGTH characters each, the config labels
at most MAX_CONFIG_LABELS: trainer_hook.contract), never with steps times keys.
"""
from __future__ import annotations

import math
from typing import Any

from prometheus_client.utils import floatToGoString
from trainer_hook.contract import (DEFAULT_PRECISION, PRECISIONS, PREFIX, RUN_STATES, SKIP_REASON, STEP_BUCKETS,
                                   Accumulator, label_name, label_value)

from .records import Run, exported_name, number

#: The label that marks replayed series (live series never carry it).
REPLAY_LABEL = "replayed"
REPLAY_VALUE = "true"
#: Slow series are repeated at least this often (record time): a default scrape interval.
REFRESH_SECONDS = 15.0
#: ... as long as the run's record bytes read since pay for them: at most this many bytes of slow
#: series per record byte (a hook-written step line pays for a refresh by itself unless the config is
#: huge; a crafted record of tiny lines 15 s apart gets its slow series less often, never more output).
SLOW_BYTES_PER_RECORD_BYTE = 64
_BOUNDS = [repr(b) for b in STEP_BUCKETS] + ["+Inf"]


def escape(value: str) -> str:
    """A label value in OpenMetrics text."""
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def labels_text(labels: dict[str, str]) -> str:
    return ",".join(f'{name}="{escape(value)}"' for name, value in labels.items())


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
        # training_model_flops_total's precision label, as the hook's start line gives it
        precision = run.start.get("precision")
        self.precision = precision if precision in PRECISIONS else DEFAULT_PRECISION
        self.samples = 0
        self._last_ms = -1
        self._last = (-math.inf, 0)  # (time, step) of the last step line
        self._run = Accumulator()
        self._data_wait: float | None = None
        self._refreshed = -math.inf
        self._credit = 0  # record bytes of this run not yet spent on slow series
        self._slow_bytes = 0  # size of the latest refresh: the price of the next one
        self._ended = False  # an end line was written (the first one's refresh is free)
        self._keys: set[str] = set()  # keys whose training_nonfinite_values_total was written

    def read(self, size: int) -> None:
        """`size` more bytes of this run's record were read (they pay for its slow series)."""
        self._credit += size

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
        state = self._run.state
        scale = number(line.get("loss_scale"))
        folded = self._run.fold(line["step"], line["values"], exported_name, time=line["time"],
                                batch_id=line.get("batch_id"), samples=number(line.get("samples")),
                                tokens=number(line.get("tokens")),
                                duration=number(line.get("duration_seconds")),
                                skipped=int(line.get("skipped") == SKIP_REASON),
                                loss_scale=scale, flops=number(line.get("flops")))
        out = [f"training_step{{{labels}}} {line['step']}{ts}"]
        for name, value in folded.gauges.items():
            out.append(f"{PREFIX}{name}{{{labels}}} {floatToGoString(value)}{ts}")
        # At step resolution a window is one step: its largest finite value, at this step.
        for name, (value, step) in self._run.take_window().items():
            out.append(f"{PREFIX}{name}_max{{{labels}}} {floatToGoString(value)}{ts}")
            out.append(f"{PREFIX}{name}_max_step{{{labels}}} {step}{ts}")
        out.append(f"training_steps_total{{{labels}}} {state.steps_total}{ts}")
        out.append(f"training_samples_total{{{labels}}} {floatToGoString(state.samples_total)}{ts}")
        if state.tokens_total is not None:
            out.append(f"training_tokens_total{{{labels}}} {floatToGoString(state.tokens_total)}{ts}")
        if state.model_flops_total is not None:
            out.append(f'training_model_flops_total{{{labels},precision="{self.precision}"}} '
                       f'{floatToGoString(state.model_flops_total)}{ts}')
        wait = number(line.get("data_wait_seconds"))
        if wait is not None and math.isfinite(wait):
            self._data_wait = (self._data_wait or 0.0) + wait
        if self._data_wait is not None:
            out.append(f"training_data_wait_seconds_total{{{labels}}} {floatToGoString(self._data_wait)}{ts}")
        for name, value in folded.gauges.items():  # the keys this step logged: the others did not change
            out.append(f'training_logged_value_sum{{{labels},key="{name}"}} '
                       f'{floatToGoString(state.value_sums.get(name, 0.0))}{ts}')
            out.append(f'training_logged_value_count{{{labels},key="{name}"}} '
                       f'{state.value_counts.get(name, 0)}{ts}')
            if name not in self._keys or not math.isfinite(value):  # its first value, or one more
                self._keys.add(name)
                out.append(f'training_nonfinite_values_total{{{labels},key="{name}"}} '
                           f'{state.nonfinite_values.get(name, 0)}{ts}')
        out.append(f"training_nonfinite_steps_total{{{labels}}} {state.nonfinite_steps_total}{ts}")
        if state.skipped_steps_total:
            out.append(f'training_skipped_steps_total{{{labels},reason="{SKIP_REASON}"}} '
                       f'{state.skipped_steps_total}{ts}')
        if scale is not None:
            out.append(f"training_loss_scale{{{labels}}} {floatToGoString(scale)}{ts}")
        cuda = line.get("cuda")
        if isinstance(cuda, dict):
            for field, name in (("allocated", "allocated"), ("reserved", "reserved")):
                value = number(cuda.get(field))
                if value is not None:
                    out.append(f"training_cuda_memory_{name}_bytes{{{labels}}} {floatToGoString(value)}{ts}")
        if folded.nonfinite or line["time"] - self._refreshed >= REFRESH_SECONDS:
            slow = self._refresh("running", ts)
            if slow:
                self._refreshed = line["time"]
                out.extend(slow)
        self.samples += len(out)
        return "".join(out)

    def end(self, line: dict[str, Any]) -> str:
        """The samples of the end line: the final state, and everything slow once more."""
        state = line.get("state") if line.get("state") in RUN_STATES else "failed"
        ts = self._stamp(float(line["time"]))
        out = self._refresh(state, ts, paid=not self._ended) or self._states(state, ts)
        self._ended = True
        if state == "failed" and isinstance(line.get("reason"), str) and line["reason"]:
            # What the live hook pushes: the class of the exception that ended the run.
            out.append(f'training_run_failure_info{{{self.labels},reason="{escape(line["reason"])}"}} 1{ts}')
        self.samples += len(out)
        return "".join(out)

    def _refresh(self, run_state: str, ts: str, paid: bool = False) -> list[str]:
        """The slow series, if the bytes read pay for them (SLOW_BYTES_PER_RECORD_BYTE) or they are
        `paid` for already (the run's first end line); else []."""
        if not paid and self._credit * SLOW_BYTES_PER_RECORD_BYTE < self._slow_bytes:
            return []
        out = self._slow(run_state, ts)
        self._slow_bytes = sum(map(len, out))
        self._credit = max(0, self._credit - self._slow_bytes // SLOW_BYTES_PER_RECORD_BYTE)
        return out

    def _states(self, run_state: str, ts: str) -> list[str]:
        return [f"training_run_state{{{self.labels},state=\"{name}\"}} {int(name == run_state)}{ts}"
                for name in RUN_STATES]

    def _slow(self, run_state: str, ts: str) -> list[str]:
        labels, start, state = self.labels, self.run.start, self._run.state
        out = self._states(run_state, ts)
        out.append(f"training_run_info{{{self.info_labels}}} 1{ts}")
        if self.run.start_time is not None:
            out.append(f"training_start_timestamp_seconds{{{labels}}} {floatToGoString(self.run.start_time)}{ts}")
        out.append(f"training_last_update_timestamp_seconds{{{labels}}} {floatToGoString(state.last_update)}{ts}")
        for key in ("world_size", "local_rank"):
            value = number(start.get(key))
            if value is not None:
                out.append(f"training_{key}{{{labels}}} {floatToGoString(value)}{ts}")
        for name in ("first_nonfinite_step", "first_nonfinite_batch_id", "last_nonfinite_step",
                     "last_nonfinite_batch_id"):
            out.append(f"training_{name}{{{labels}}} {floatToGoString(getattr(state, name))}{ts}")
        if not state.skipped_steps_total:  # once it counts, it is written at every step
            out.append(f'training_skipped_steps_total{{{labels},reason="{SKIP_REASON}"}} 0{ts}')
        buckets = self._run.cumulative_buckets()
        for bound, count in zip(_BOUNDS, buckets):
            out.append(f'training_step_duration_seconds_bucket{{{labels},le="{bound}"}} {count}{ts}')
        out.append(f"training_step_duration_seconds_count{{{labels}}} {buckets[-1]}{ts}")
        out.append(f"training_step_duration_seconds_sum{{{labels}}} {floatToGoString(state.duration_sum)}{ts}")
        return out
