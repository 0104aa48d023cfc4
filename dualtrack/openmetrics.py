"""Record lines -> OpenMetrics samples with the live series' names and labels, one step at a time.

Each step line is folded into the exported state by the live hook's own aggregation
(trainer_hook.contract.Accumulator) and becomes the samples a scrape of the Pushgateway would have
shown right after that step, stamped with the step's own time: per-step series (training_step, the
counters) at every step; a logged key's series (training_<key>, its sum, count and non-finite count)
at the steps that log it; slowly changing ones (state, info, start time, histogram, non-finite
markers) when they change and at least every REFRESH_SECONDS of record time, so that PromQL's
5-minute lookback always finds them. Every series carries REPLAY_LABEL. Sample names and label names
come from the series' declaration (trainer_hook.contract.SERIES) through sample_head(), never spelled here.

So a step's samples are a fixed number plus a few per key the step line holds: the output grows
linearly with the record (the labels are at most MAX_LABEL_LENGTH characters each, the config labels
at most MAX_CONFIG_LABELS: trainer_hook.contract), never with steps times keys.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from prometheus_client.utils import floatToGoString

from trainer_hook.contract import (
    DEFAULT_PRECISION,
    PRECISIONS,
    PREFIX,
    RUN_STATES,
    SERIES_BY_NAME,
    SKIP_REASON,
    STEP_BUCKETS,
    WINDOW_MAX_KEYS,
    Accumulator,
    Series,
    label_name,
    label_value,
    logged_series,
    pause_reason,
    window_series,
)

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
#: The histogram's label for a bucket's upper bound (prometheus_client adds it after the declared labels).
_BOUND_LABEL = "le"


def escape(value: str) -> str:
    """A label value in OpenMetrics text."""
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def labels_text(labels: dict[str, str]) -> str:
    return ",".join(f'{name}="{escape(value)}"' for name, value in labels.items())


def sample_open(series: Series, run_labels: str, sample: str | None = None) -> str:
    """'training_<sample name>{<run_labels>': the start of a sample of a declared `series`.

    The sample name is the one prometheus_client exposes (Series.sample_names): a gauge's own name,
    a counter's with `_total`; of a summary or a histogram, `sample` says which ("_sum", "_count",
    "_bucket"). Raises ValueError for a sample the series does not have.
    """
    names = series.sample_names()
    samples = names[1:] or names  # a gauge's one sample is named as its family
    if sample is None and len(samples) == 1:
        return f"{PREFIX}{samples[0]}{{{run_labels}"
    if sample is not None and series.name + sample in samples:
        return f"{PREFIX}{series.name}{sample}{{{run_labels}"
    raise ValueError(f"{PREFIX}{series.name} has no sample {sample!r}: its samples are {samples}")


def label_tail(series: Series, *values: str, sample: str | None = None) -> str:
    """',<label>="<value>",...} ': the declared labels of `series` in declared order, with `values`
    (a histogram's "_bucket" `sample`: then the bound). Raises ValueError unless there is one value
    per label."""
    names = series.labels + ((_BOUND_LABEL,) if series.type == "histogram" and sample == "_bucket" else ())
    if len(values) != len(names):
        raise ValueError(f"{PREFIX}{series.name} has the labels {names}, not the values {values}")
    return "".join(f',{name}="{escape(value)}"' for name, value in zip(names, values)) + "} "


def sample_head(series: Series, run_labels: str, *values: str, sample: str | None = None) -> str:
    """What a sample of `series` writes before its value: its name and labels (sample_open, label_tail)."""
    return sample_open(series, run_labels, sample) + label_tail(series, *values, sample=sample)


class _Key(NamedTuple):
    """How the samples of one logged key start, for one run."""

    gauge: str  # training_<key>'s head
    value: str  # the label tail of training_logged_value_sum/_count{key}
    nonfinite: str  # the label tail of training_nonfinite_values_total{key}


_LOGGED_VALUE = SERIES_BY_NAME["logged_value"]
_NONFINITE_VALUES = SERIES_BY_NAME["nonfinite_values"]
_STEP_DURATION = SERIES_BY_NAME["step_duration_seconds"]
#: Record fields -> the declared series they become.
_CUDA_FIELDS = (("allocated", SERIES_BY_NAME["cuda_memory_allocated_bytes"]),
                ("reserved", SERIES_BY_NAME["cuda_memory_reserved_bytes"]))
_START_FIELDS = tuple((key, SERIES_BY_NAME[key]) for key in ("world_size", "local_rank"))
_MARKERS = tuple((name, SERIES_BY_NAME[name]) for name in (  # Snapshot attributes, named as their series
    "first_nonfinite_step", "first_nonfinite_batch_id", "last_nonfinite_step", "last_nonfinite_batch_id"))


class RunSeries:
    """The OpenMetrics state of one replayed run (one rank): counters, markers, last timestamp.

    Every sample starts with a head that sample_head() made from the series' declaration
    (trainer_hook.contract.SERIES), once per run (once per key for a logged key's series).
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        base = {"job": run.job, "run": run.run, "rank": run.rank, "instance": run.instance,
                REPLAY_LABEL: REPLAY_VALUE}
        self.labels = labels = labels_text(base)
        config = {}
        for key, value in run.config.items():
            name = label_name(key)
            config["config_" + name if name in base else name] = label_value(value)
        self.info_labels = labels_text({**base, **config})
        # training_model_flops_total's precision label, as the hook's start line gives it
        precision = run.start.get("precision")
        self.precision = precision if precision in PRECISIONS else DEFAULT_PRECISION

        def head(name: str, *values: str) -> str:
            return sample_head(SERIES_BY_NAME[name], labels, *values)

        self._step_head, self._steps, self._samples = head("step"), head("steps"), head("samples")
        self._tokens, self._flops = head("tokens"), head("model_flops", self.precision)
        self._data_wait_head, self._nonfinite_steps = head("data_wait_seconds"), head("nonfinite_steps")
        self._skipped = head("skipped_steps", SKIP_REASON)
        self._loss_scale = sample_head(logged_series("loss_scale"), labels)
        self._maxima = {key: tuple(sample_head(series, labels) for series in window_series(key))
                        for key in WINDOW_MAX_KEYS}
        self._cuda = tuple((field, sample_head(series, labels)) for field, series in _CUDA_FIELDS)
        self._value_sum = sample_open(_LOGGED_VALUE, labels, "_sum")
        self._value_count = sample_open(_LOGGED_VALUE, labels, "_count")
        self._nonfinite_values = sample_open(_NONFINITE_VALUES, labels)
        self._keys: dict[str, _Key] = {}  # keys logged so far (their training_nonfinite_values_total was written)
        self._pauses: dict[str, tuple[str, str]] = {}  # reason -> heads of its pause series
        self._paused: dict[str, float] = {}  # reason -> seconds paused so far
        # The slow series
        self._states_heads = tuple((name, head("run_state", name)) for name in RUN_STATES)
        self._run_info = sample_head(SERIES_BY_NAME["run_info"], self.info_labels)
        self._launch_info = head("launch_info", run.launch) if run.launch else None
        self._start_time, self._last_update = head("start_timestamp_seconds"), head("last_update_timestamp_seconds")
        self._start_fields = tuple((key, sample_head(series, labels)) for key, series in _START_FIELDS)
        self._markers = tuple((name, sample_head(series, labels)) for name, series in _MARKERS)
        self._buckets = tuple(sample_head(_STEP_DURATION, labels, bound, sample="_bucket") for bound in _BOUNDS)
        self._duration_count = sample_head(_STEP_DURATION, labels, sample="_count")
        self._duration_sum = sample_head(_STEP_DURATION, labels, sample="_sum")

        self.samples = 0
        self._last_ms = -1
        self._last = (-math.inf, 0)  # (time, step) of the last step line
        self._run = Accumulator()
        self._data_wait: float | None = None
        self._refreshed = -math.inf
        self._credit = 0  # record bytes of this run not yet spent on slow series
        self._slow_bytes = 0  # size of the latest refresh: the price of the next one
        self._ended = False  # an end line was written (the first one's refresh is free)

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

    def _key(self, name: str) -> _Key:
        """The heads of a logged key's series (a key's first value makes them)."""
        return _Key(sample_head(logged_series(name), self.labels), label_tail(_LOGGED_VALUE, name),
                    label_tail(_NONFINITE_VALUES, name))

    def step(self, line: dict[str, Any]) -> str:
        """The samples of one step line (call in_order() first)."""
        ts = self._stamp(line["time"])
        state = self._run.state
        scale = number(line.get("loss_scale"))
        folded = self._run.fold(line["step"], line["values"], exported_name, time=line["time"],
                                batch_id=line.get("batch_id"), samples=number(line.get("samples")),
                                tokens=number(line.get("tokens")),
                                duration=number(line.get("duration_seconds")),
                                skipped=int(line.get("skipped") == SKIP_REASON),
                                loss_scale=scale, flops=number(line.get("flops")))
        out = [f"{self._step_head}{line['step']}{ts}"]
        logged = []  # (key, its value, its heads, whether it is the key's first value)
        for name, value in folded.gauges.items():
            key = self._keys.get(name)
            if key is None:
                key = self._keys[name] = self._key(name)
                logged.append((name, value, key, True))
            else:
                logged.append((name, value, key, False))
            out.append(f"{key.gauge}{floatToGoString(value)}{ts}")
        # At step resolution a window is one step: its largest finite value, at this step.
        for name, (value, step) in self._run.take_window().items():
            largest, at = self._maxima[name]
            out.append(f"{largest}{floatToGoString(value)}{ts}")
            out.append(f"{at}{step}{ts}")
        out.append(f"{self._steps}{state.steps_total}{ts}")
        out.append(f"{self._samples}{floatToGoString(state.samples_total)}{ts}")
        if state.tokens_total is not None:
            out.append(f"{self._tokens}{floatToGoString(state.tokens_total)}{ts}")
        if state.model_flops_total is not None:
            out.append(f"{self._flops}{floatToGoString(state.model_flops_total)}{ts}")
        wait = number(line.get("data_wait_seconds"))
        if wait is not None and math.isfinite(wait):
            self._data_wait = (self._data_wait or 0.0) + wait
        if self._data_wait is not None:
            out.append(f"{self._data_wait_head}{floatToGoString(self._data_wait)}{ts}")
        value_sum, value_count, nonfinite = self._value_sum, self._value_count, self._nonfinite_values
        for name, value, key, first in logged:  # the keys this step logged: the others did not change
            out.append(f"{value_sum}{key.value}{floatToGoString(state.value_sums.get(name, 0.0))}{ts}")
            out.append(f"{value_count}{key.value}{state.value_counts.get(name, 0)}{ts}")
            if first or not math.isfinite(value):  # its first value, or one more
                out.append(f"{nonfinite}{key.nonfinite}{state.nonfinite_values.get(name, 0)}{ts}")
        out.append(f"{self._nonfinite_steps}{state.nonfinite_steps_total}{ts}")
        if state.skipped_steps_total:
            out.append(f"{self._skipped}{state.skipped_steps_total}{ts}")
        if scale is not None:
            out.append(f"{self._loss_scale}{floatToGoString(scale)}{ts}")
        cuda = line.get("cuda")
        if isinstance(cuda, dict):
            for field, head in self._cuda:
                value = number(cuda.get(field))
                if value is not None:
                    out.append(f"{head}{floatToGoString(value)}{ts}")
        if folded.nonfinite or line["time"] - self._refreshed >= REFRESH_SECONDS:
            slow = self._refresh("running", ts)
            if slow:
                self._refreshed = line["time"]
                out.extend(slow)
        self.samples += len(out)
        return "".join(out)

    def pause(self, line: dict[str, Any]) -> str:
        """The samples of a pause line: training_pause_start_timestamp_seconds{reason} at its start
        and end, and training_paused_seconds_total{reason} grown by its length at its end."""
        reason = pause_reason(line["reason"])
        heads = self._pauses.get(reason)
        if heads is None:
            heads = self._pauses[reason] = (sample_head(SERIES_BY_NAME["pause_start_timestamp_seconds"], self.labels,
                                                        reason),
                                            sample_head(SERIES_BY_NAME["paused_seconds"], self.labels, reason))
        start, total = heads
        began, seconds = line["time"], line["seconds"]
        self._paused[reason] = self._paused.get(reason, 0.0) + seconds
        out = [f"{total}{floatToGoString(self._paused[reason] - seconds)}{self._stamp(began)}",
               f"{start}{floatToGoString(began)}{self._stamp(began)}",
               f"{start}{floatToGoString(began)}{self._stamp(began + seconds)}",
               f"{total}{floatToGoString(self._paused[reason])}{self._stamp(began + seconds)}"]
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
            out.append(f'{sample_head(SERIES_BY_NAME["run_failure_info"], self.labels, line["reason"])}1{ts}')
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
        return [f"{head}{int(name == run_state)}{ts}" for name, head in self._states_heads]

    def _slow(self, run_state: str, ts: str) -> list[str]:
        start, state = self.run.start, self._run.state
        out = self._states(run_state, ts)
        out.append(f"{self._run_info}1{ts}")
        if self._launch_info is not None:
            out.append(f"{self._launch_info}1{ts}")
        if self.run.start_time is not None:
            out.append(f"{self._start_time}{floatToGoString(self.run.start_time)}{ts}")
        out.append(f"{self._last_update}{floatToGoString(state.last_update)}{ts}")
        for key, head in self._start_fields:
            value = number(start.get(key))
            if value is not None:
                out.append(f"{head}{floatToGoString(value)}{ts}")
        for name, head in self._markers:
            out.append(f"{head}{floatToGoString(getattr(state, name))}{ts}")
        if not state.skipped_steps_total:  # once it counts, it is written at every step
            out.append(f"{self._skipped}0{ts}")
        buckets = self._run.cumulative_buckets()
        for head, count in zip(self._buckets, buckets):
            out.append(f"{head}{count}{ts}")
        out.append(f"{self._duration_count}{buckets[-1]}{ts}")
        out.append(f"{self._duration_sum}{floatToGoString(state.duration_sum)}{ts}")
        return out
