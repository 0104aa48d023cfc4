"""The hook's metric contract, without torch: what the live hook exports and `dualtrack replay` rebuilds.

One place for the series names (how a logged key becomes `training_<key>`, the reserved names),
the run states, the record format version, and the aggregation of one step into the exported state:
sums and counts of finite values, non-finite counts, the non-finite streak, skipped steps, the
step-duration histogram and the window maxima: the largest *finite* value and its step, so that a
spike followed at once by Inf is still named (the Inf is counted in the non-finite series). The live
hook (trainer_hook.aggregate, on its background thread) and replay (dualtrack.openmetrics, from
record lines) both call `Accumulator.fold`, so the two cannot drift apart.

Imports only the standard library: `import trainer_hook.contract` never loads torch.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .masking import MASK, mask_text
from .text import one_line

PREFIX = "training_"
#: The record format written on start lines ("format"); lines without it are format 1.
FORMAT_VERSION = 2
#: training_run_state{state}: one of these is 1.
RUN_STATES = ("running", "finished", "failed")
#: training_rank_phase{phase}: one of these is 1 (what the training thread does; trainer_hook.collectives).
PHASES = ("loader", "compute", "collective", "paused")
#: Upper bounds (seconds) of training_step_duration_seconds; +Inf is implicit.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0)
#: Precisions of training_model_flops_total{precision}: which of its GPUs' peak FLOP/s the run's MFU
#: divides by (rules/gpu_peaks.yml, generated from dualtrack/gpu_peaks.py).
PRECISIONS = ("fp8", "bf16", "fp16", "tf32", "fp32")
#: Neither given nor detected (trainer_hook/precision.py): no peak matches it, so the run has no MFU.
DEFAULT_PRECISION = "unknown"
#: Keys exported with a window maximum (training_<key>_max) and its step (training_<key>_max_step).
WINDOW_MAX_KEYS = ("loss", "grad_norm", "learning_rate")
#: Keys whose non-finite value on a step the GradScaler skipped is the overflow itself, not a fault.
OVERFLOW_KEYS = ("grad_norm",)


def is_overflow(suffix: str, skipped: object) -> bool:
    """A non-finite `suffix` on a step the GradScaler skipped is the overflow itself, not a fault:
    it neither counts as non-finite nor makes the step non-finite."""
    return bool(skipped) and suffix in OVERFLOW_KEYS


#: training_skipped_steps_total{reason}, and the record's "skipped" field.
SKIP_REASON = "overflow"
#: training_dropped_values_total{reason}: why a logged value was not kept.
DROP_REASONS = ("invalid_key", "not_numeric", "not_scalar", "out_of_range", "unreadable",
                "reserved_name", "too_many_keys")
#: Characters kept of a label value (identity labels, config values); a longer log key is invalid.
MAX_LABEL_LENGTH = 256
#: Distinct logged keys exported per run: values of later keys stay in the record, counted as dropped
#: (reason "too_many_keys"). The live hook and replay fold steps with the same Accumulator.
MAX_KEYS = 1024
#: Config entries exported as training_run_info labels (the first ones by name).
MAX_CONFIG_LABELS = 256
#: Words of a config key whose value is a secret: its value is logged as MASK (see mask_secrets).
SECRET_WORDS = frozenset({"token", "secret", "secrets", "password", "passwords", "passwd", "pwd",
                          "passphrase", "apikey", "key", "credential", "credentials", "auth",
                          "authorization", "cookie", "api", "dsn"})
#: W&B/HF spellings of the standard keys.
ALIASES = {"lr": "learning_rate", "gradnorm": "grad_norm", "total_grad_norm": "grad_norm",
           "grad_norm_total": "grad_norm", "train_loss": "loss"}


class Series(NamedTuple):
    """One model-track series as the hook exports it (and replay rebuilds it): `training_<name>`.

    Not exporter.metrics.MetricSpec: the hook imports no other package (tests/repo/test_layering.py), and a
    MetricSpec names a family by its samples' name (a counter's `_total` included) for the exporter's
    own text writer, where prometheus_client, which builds the hook's families, takes it without."""

    name: str  # after PREFIX; a counter's family name, without _total
    type: str  # "gauge", "counter", "summary" or "histogram"
    help: str
    labels: tuple[str, ...] = ()  # besides job, run, rank, instance (and pull mode's constant labels)

    def sample_names(self) -> tuple[str, ...]:
        """Its family name and the names its samples carry (after PREFIX)."""
        return tuple(self.name + suffix for suffix in _SAMPLE_SUFFIXES[self.type])


_SAMPLE_SUFFIXES = {"gauge": ("",), "counter": ("", "_total"), "summary": ("", "_sum", "_count"),
                    "histogram": ("", "_bucket", "_count", "_sum")}


def window_series(key: str) -> tuple[Series, Series]:
    """The gauges of a window-maximum key (WINDOW_MAX_KEYS): its largest value and that value's step."""
    return (Series(f"{key}_max", "gauge", f"Largest finite {key} over the steps of the last max_hold seconds, at "
                   "least since the previous push (NaN/Inf are counted in training_nonfinite_values_total)."),
            Series(f"{key}_max_step", "gauge", f"Step at which training_{key}_max was seen."))


#: Every series the hook computes itself, in exposition order: the one declaration the live exposition
#: (trainer_hook.families), remote write, replay (dualtrack.openmetrics), RESERVED and the docs' tables
#: follow (tests/trainer_hook/test_contract.py checks each). A logged key's own gauge (training_<key>) is
#: logged_series().
SERIES: tuple[Series, ...] = (
    Series("step", "gauge", "Step passed to the last log() call."),
    *(series for key in WINDOW_MAX_KEYS for series in window_series(key)),
    Series("logged_value", "summary", "Finite logged values per key: rate(_sum)/rate(_count) is their exact "
           "mean over any range.", ("key",)),
    Series("nonfinite_values", "counter", "NaN or infinite logged values per key (never in "
           "training_logged_value_sum).", ("key",)),
    Series("steps", "counter", "log() calls (training steps) so far."),
    Series("samples", "counter", "Samples passed as samples= so far."),
    Series("tokens", "counter", "Tokens passed as tokens= so far."),
    Series("model_flops", "counter", "Model FLOPs of the steps so far (flops_per_token x tokens, flops_per_sample "
           "x samples, or the estimate 6 x parameters x tokens); precision: the peak FLOP/s the run's MFU divides "
           "by.", ("precision",)),
    Series("step_duration_seconds", "histogram", "Wall time between consecutive log() calls."),
    Series("data_wait_seconds", "counter", "Time the training loop waited for its batches (loader(), "
           "log(data_wait=))."),
    Series("nonfinite_steps", "counter", "Steps with a NaN or infinite logged value (not counting a "
           "GradScaler overflow)."),
    Series("first_nonfinite_step", "gauge", "First step of the current (or latest) streak of non-finite "
           "steps; -1 until one happens."),
    Series("first_nonfinite_batch_id", "gauge", "batch_id of training_first_nonfinite_step; -1 until one "
           "happens (or when not numeric)."),
    Series("last_nonfinite_step", "gauge", "Step of the last non-finite value; -1 until one happens."),
    Series("last_nonfinite_batch_id", "gauge", "batch_id of the last non-finite value; -1 until one happens."),
    Series("skipped_steps", "counter", "Optimizer steps the watched GradScaler skipped.", ("reason",)),
    Series("paused_seconds", "counter", "Seconds this rank spent inside monitor.paused(reason) (a checkpoint, an "
           "evaluation), the current pause included.", ("reason",)),
    Series("pause_start_timestamp_seconds", "gauge", "Unix time the rank's current pause began, labelled with its "
           "reason; absent while the rank is not paused.", ("reason",)),
    Series("replica_compared_steps", "counter", "Steps at which this data-parallel rank's post-reduction grad norm "
           "was compared with its peers' (DDP)."),
    Series("replica_divergent_steps", "counter", "Compared steps at which this rank's post-reduction grad norm was "
           "not the one most of its data-parallel peers hold (bitwise): a corrupted replica."),
    Series("last_update_timestamp_seconds", "gauge", "Unix time of the last log() call."),
    Series("start_timestamp_seconds", "gauge", "Unix time the monitor was created."),
    Series("last_push_timestamp_seconds", "gauge", "Unix time the hook published this state (every push "
           "interval, pushed, remote-written or served): what staleness rules compare with time()."),
    Series("run_state", "gauge", "1 for the run's current state.", ("state",)),
    Series("run_failure_info", "gauge", "Why the run failed, value 1: the class of the exception that ended "
           "it (or SIGTERM).", ("reason",)),
    Series("run_info", "gauge", "Hyper-parameters of the run as labels."),  # and one label per config entry
    Series("gpu_info", "gauge", "GPUs this rank trains on.", ("gpu", "uuid")),
    Series("local_rank", "gauge", "Rank of this process on its node (picks the GPU)."),
    Series("world_size", "gauge", "Processes in the run."),
    Series("process_info", "gauge", "The process that publishes these series: pid in its own PID namespace, "
           "start_time in clock ticks since boot (join nvml_gpu_process_* on namespace_pid = pid and "
           "start_time).", ("pid", "hostname", "pid_namespace", "start_time")),
    Series("launch_info", "gauge", "This launch of the run, value 1: a run id launched again (a restart, a "
           "relaunch) is a new launch with its own id.", ("launch",)),
    Series("dropped_values", "counter", "Logged values that were not kept.", ("reason",)),
    Series("push_failures", "counter", "Failed pushes to the Pushgateway, and remote-write requests or "
           "batches of samples that were dropped."),
    Series("record_failures", "counter", "Failed writes to the local record file."),
    Series("cuda_memory_allocated_bytes", "gauge", "CUDA caching allocator: allocated bytes."),
    Series("cuda_memory_reserved_bytes", "gauge", "CUDA caching allocator: reserved bytes."),
    Series("cuda_alloc_retries", "counter", "CUDA allocator retries after a failed allocation."),
    Series("cuda_ooms", "counter", "CUDA out-of-memory errors raised by the allocator."),
    Series("collective_wait_seconds", "counter", "Time this rank waited in its data-parallel collectives (DDP "
           "gradient all-reduces timed by watch()): the rank the others wait for waits least."),
    Series("compute_seconds", "counter", "Time between log() calls spent outside the timed collectives and the "
           "data loader."),
    Series("collectives", "counter", "Data-parallel collectives (DDP gradient all-reduces) completed."),
    Series("collective_sequence", "gauge", "Number of the last data-parallel collective this rank entered (the "
           "one it is in when training_rank_phase{phase=\"collective\"} is 1)."),
    Series("rank_phase", "gauge", "1 for what the training thread does now: in its data loader, inside a "
           "collective, computing, or paused.", ("phase",)),
    Series("rank_frame_info", "gauge", "The innermost frame of the project's code on the training thread, while "
           "no step was logged for two push intervals (sampled, no signal, no sync).", ("frame",)),
)
SERIES_BY_NAME = {series.name: series for series in SERIES}
#: Log keys with a documented meaning (their gauge's HELP); any other numeric key is a plain gauge.
KNOWN_KEYS = {
    "loss": "Training loss at the last logged step.",
    "learning_rate": "Learning rate at the last logged step (first parameter group with watch()).",
    "grad_norm": "Total L2 gradient norm at the last logged step.",
    "epoch": "Epoch at the last logged step.",
    "loss_scale": "Loss scale of the watched GradScaler after the last logged step.",
    "max_steps": "Optimizer steps the run plans, when logged (the ETA rules read it).",
    "batch_size": "Batch size at the last logged step, when logged (explain's hyperparameter cause reads it).",
}


def logged_series(key: str) -> Series:
    """The gauge of a logged key (training_<key>): its last value."""
    return Series(key, "gauge", KNOWN_KEYS.get(key, f"Last logged value of the {key!r} key."))


#: Names a log key may not take: the family and sample names of every series the hook computes itself.
RESERVED = frozenset(name for series in SERIES for name in series.sample_names())
RESERVED_LABELS = frozenset({"job", "run", "rank", "instance", "le", "quantile"})

_NOT_NAME = re.compile(r"[^A-Za-z0-9_]+")
_UNDERSCORES = re.compile("_{2,}")
_SECTION = re.compile(r"^(train|training)/", re.IGNORECASE)
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


# ---------------------------------------------------------------------- names and labels
class Dropped(str):
    """A value that is not kept; the string is the reason (one of DROP_REASONS)."""


def _sanitize(text: str) -> str:
    """Letters, digits and single underscores: "a.b--c" -> "a_b_c"."""
    return _UNDERSCORES.sub("_", _NOT_NAME.sub("_", text).strip("_"))


def metric_suffix(key: object) -> str | Dropped:
    """The metric name after `training_` for a log key, e.g. "train/loss" -> "loss"."""
    name = _sanitize(_SECTION.sub("", str(key).strip()))
    name = ALIASES.get(name.lower(), name)
    if not name or len(name) > MAX_LABEL_LENGTH:
        return Dropped("invalid_key")
    if name in RESERVED:
        return Dropped("reserved_name")
    return name


def label_name(key: object) -> str:
    """A valid, non-reserved Prometheus label name for a config key."""
    name = _sanitize(str(key))[:MAX_LABEL_LENGTH] or "key"
    if name[0].isdigit() or name in RESERVED_LABELS:
        name = "config_" + name
    return name


def label_value(value: object) -> str:
    """A printable, bounded label value: control characters become spaces (text.one_line), UTF-8 safe."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, default=str, ensure_ascii=False, sort_keys=True)
    else:
        text = str(value)
    text = one_line(text, blank=True).encode("utf-8", "replace").decode("utf-8")
    return text[:MAX_LABEL_LENGTH]


def pause_reason(reason: object) -> str:
    """A paused() reason as the `reason` label (and replay) shows it: label_value(), never empty."""
    return label_value(reason).strip() or "unspecified"


def is_secret(key: object) -> bool:
    """True for a config key that names a secret: one of its words (split at `_`, `-`, `.`, `/`,
    digits and camelCase, case-insensitive) is in SECRET_WORDS ("hub_token", "apiKey", "DB_PASSWORD",
    "wandb.api_key"), not "max_grad_norm", "max_tokens" or "tokenizer"."""
    return any(word.lower() in SECRET_WORDS for word in _WORDS.findall(str(key)))


def mask_secrets(value: Any) -> Any:
    """`value` with the value of every secret key (is_secret), at any depth of mappings and lists,
    replaced by MASK, and in every other string the secrets its value shows (masking.mask_text: URL
    userinfo and queries, token shapes): the one filter for configs the hook logs (its start line,
    training_run_info, the framework integrations' hyper-parameters) and replay re-exports."""
    if isinstance(value, Mapping):
        return {key: MASK if is_secret(key) else mask_secrets(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_secrets(item) for item in value]
    return mask_text(value) if isinstance(value, str) else value


def config_labels(config: Mapping[str, Any] | None) -> dict[str, str]:
    """Hyper-parameters as labels: secrets masked (mask_secrets), nested mappings flattened with `_`,
    names and values sanitized, at most MAX_CONFIG_LABELS of them (the first by name)."""
    labels: dict[str, str] = {}

    def walk(prefix: str, mapping: Mapping[Any, Any]) -> None:
        for key, value in mapping.items():
            name = f"{prefix}_{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                walk(name, value)
            else:
                labels[label_name(name)] = label_value(value)

    if config:
        walk("", mask_secrets(config))
    return dict(sorted(labels.items())[:MAX_CONFIG_LABELS])


# ---------------------------------------------------------------------- record numbers
def json_number(value: float | None) -> float | str | None:
    """JSON has no NaN/Infinity: non-finite values are written as "nan", "inf", "-inf"."""
    return value if value is None or math.isfinite(value) else str(value)


def record_id(batch_id: Any) -> Any:
    """A batch id as the record holds it: numbers (numpy's too) as JSON numbers, the rest as given."""
    if type(batch_id) in (int, float, str) or batch_id is None or isinstance(batch_id, bool) \
            or not isinstance(batch_id, numbers.Real):
        return batch_id
    return int(batch_id) if isinstance(batch_id, numbers.Integral) else json_number(float(batch_id))


def numeric_id(batch_id: Any) -> float:
    """A batch id as training_*_nonfinite_batch_id shows it: a number (not a bool), else -1."""
    if isinstance(batch_id, numbers.Real) and not isinstance(batch_id, bool):
        return float(batch_id)
    return -1.0


# ---------------------------------------------------------------------- the exported state
#: Keys of the record's start line that say which process wrote it (format 2; pid_namespace since it
#: is known: with pid, the pair the exporter's per-process series match across PID namespaces; launch:
#: which launch of the run id this is, shared by the ranks of one launch).
START_PROCESS_KEYS = ("local_rank", "world_size", "pid", "pid_namespace", "launch")


class ProcessIdentity(NamedTuple):
    """The pushing process (training_local_rank, training_world_size, training_process_info)."""

    local_rank: int = 0
    world_size: int = 1
    pid: int = 0
    hostname: str = ""
    pid_namespace: str = ""  # inode of the PID namespace `pid` is in (decimal): with `pid`, what NVML's host PID is
    start_time: str = ""  # clock ticks since boot it started at (/proc/self/stat field 22): with `pid`, names it
    launch: str = ""  # this launch of the run id (settings.launch_id)


@dataclass
class Snapshot:
    """The state published once per push interval (what both push and pull expose).

    A published snapshot is never changed (pull mode may be serving it): derive a new one with
    dataclasses.replace or merge_maxima.
    """

    gauges: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)  # largest finite value of the window
    max_steps: dict[str, int] = field(default_factory=dict)  # step at which each maximum was seen
    value_sums: dict[str, float] = field(default_factory=dict)  # finite values only
    value_counts: dict[str, int] = field(default_factory=dict)
    nonfinite_values: dict[str, int] = field(default_factory=dict)
    step: int = -1
    steps_total: int = 0
    samples_total: float = 0.0
    tokens_total: float | None = None
    model_flops_total: float | None = None  # None until a step's model FLOPs are known
    bucket_counts: tuple[int, ...] = (0,) * (len(STEP_BUCKETS) + 1)  # cumulative
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
    paused_seconds: dict[str, float] = field(default_factory=dict)  # by reason, the current pause included
    pause: tuple[str, float] | None = None  # the current pause: (reason, Unix time it began)
    replica: tuple[int, int] | None = None  # (compared, divergent) steps, once the comparison runs
    state: str = "running"
    precision: str = DEFAULT_PRECISION  # of training_model_flops_total
    failure_reason: str = ""  # a failed run's end: the exception's class name (or "SIGTERM")
    start_time: float = 0.0
    published: float = 0.0  # Unix time of the publish (training_last_push_timestamp_seconds)
    push_failures: int = 0
    record_failures: int = 0
    run_labels: dict[str, str] = field(default_factory=dict)
    gpus: tuple[tuple[str, str], ...] = ()
    cuda: dict[str, float] | None = None
    process: ProcessIdentity = ProcessIdentity()
    collective_wait: float | None = None  # None: the collectives are not timed (collectives.py)
    compute: float = 0.0
    collectives_total: int = 0
    collective_sequence: int = 0
    phase: str = "compute"  # one of PHASES
    frame: str = ""  # the training thread's innermost project frame, while steps stall


class Folded(NamedTuple):
    """What one step changed: the gauges it set (suffix -> value) and its non-finite keys."""

    gauges: dict[str, float]
    nonfinite: list[Any]


Window = dict[str, tuple[float, int]]  # suffix -> (largest finite value, its step)


class Accumulator:
    """The exported state of one rank, one step at a time (the hook's and replay's one aggregation)."""

    def __init__(self) -> None:
        self.state = Snapshot()
        self.bucket_counts = [0] * (len(STEP_BUCKETS) + 1)  # not cumulative
        self.window: Window = {}  # since the last take_window()
        self._in_streak = False  # the previous step that was not skipped had a non-finite value
        self._keys: set[str] = set()  # the exported keys, at most MAX_KEYS

    def fold(self, step: int, values: Mapping[Any, float], name: Callable[[Any], str | None], *,
             time: float, batch_id: Any = None, samples: float | None = None,
             tokens: float | None = None, duration: float | None = None, skipped: int = 0,
             loss_scale: float | None = None, flops: float | None = None) -> Folded:
        """Fold one step in. `values`: logged key -> float; `name(key)`: its suffix (None: not exported).

        A non-finite value counts in training_nonfinite_values_total and makes the step non-finite,
        except an overflow (OVERFLOW_KEYS) on a step the GradScaler skipped: that one changes
        nothing, and a skipped step neither starts nor ends a non-finite streak. Only finite values
        go into the sums and the window maxima; on a tie the earlier step is kept. Keys beyond the
        first MAX_KEYS of the run are counted in state.dropped["too_many_keys"], nothing else.
        `flops`: the step's model FLOPs (training_model_flops_total), when known.
        """
        state = self.state
        state.step = step
        gauges: dict[str, float] = {}
        nonfinite: list[Any] = []
        for key, value in values.items():
            suffix = name(key)
            if suffix is None:
                continue
            if suffix not in self._keys:
                if len(self._keys) >= MAX_KEYS:
                    state.dropped["too_many_keys"] = state.dropped.get("too_many_keys", 0) + 1
                    continue
                self._keys.add(suffix)
            if math.isfinite(value):
                state.value_sums[suffix] = state.value_sums.get(suffix, 0.0) + value
                state.value_counts[suffix] = state.value_counts.get(suffix, 0) + 1
                if suffix in WINDOW_MAX_KEYS:
                    raise_max(self.window, suffix, value, step)
            elif is_overflow(suffix, skipped):
                continue  # the GradScaler skipped this step: an overflow, not a divergence
            else:
                nonfinite.append(key)
                state.nonfinite_values[suffix] = state.nonfinite_values.get(suffix, 0) + 1
            gauges[suffix] = state.gauges[suffix] = value
        if loss_scale is not None:
            state.gauges["loss_scale"] = loss_scale
        state.steps_total += 1
        state.skipped_steps_total += skipped
        state.last_update = time
        if samples is not None and math.isfinite(samples):
            state.samples_total += samples
        if tokens is not None and math.isfinite(tokens):
            state.tokens_total = (state.tokens_total or 0.0) + tokens
        if flops is not None and math.isfinite(flops):
            state.model_flops_total = (state.model_flops_total or 0.0) + flops
        if duration is not None and math.isfinite(duration):
            self.bucket_counts[bisect.bisect_left(STEP_BUCKETS, duration)] += 1
            state.duration_sum += duration
        if nonfinite:
            if not self._in_streak:
                state.first_nonfinite_step = step
                state.first_nonfinite_batch_id = numeric_id(batch_id)
            self._in_streak = True
            state.nonfinite_steps_total += 1
            state.last_nonfinite_step = step
            state.last_nonfinite_batch_id = numeric_id(batch_id)
        elif not skipped:
            self._in_streak = False
        return Folded(gauges, nonfinite)

    def take_window(self) -> Window:
        """The maxima since the previous call (keys that had a finite value); starts a new window."""
        window, self.window = self.window, {}
        return window

    def cumulative_buckets(self) -> tuple[int, ...]:
        """training_step_duration_seconds_bucket counts, cumulative, the +Inf bucket last."""
        total, out = 0, []
        for count in self.bucket_counts:
            total += count
            out.append(total)
        return tuple(out)


def per_key(state: Snapshot) -> list[tuple[str, float, int, int]]:
    """(key, sum, count, non-finite count) for every key that has a value: the rows of
    training_logged_value_sum/_count{key} and training_nonfinite_values_total{key} (0 included)."""
    return [(key, state.value_sums.get(key, 0.0), state.value_counts.get(key, 0),
             state.nonfinite_values.get(key, 0))
            for key in sorted({*state.value_counts, *state.nonfinite_values})]


def raise_max(maxima: Window, name: str, value: float, step: int) -> None:
    """Keep the larger value and its step (the earlier step on a tie)."""
    if name not in maxima or value > maxima[name][0]:
        maxima[name] = (value, step)


def merge_maxima(older: Snapshot, newer: Snapshot) -> Snapshot:
    """`newer` with the maxima of `older` (one that never reached the Pushgateway) carried in.

    Returns a new snapshot; neither argument is changed.
    """
    maxima = {name: (value, newer.max_steps.get(name, -1)) for name, value in newer.maxima.items()}
    for name, value in older.maxima.items():
        raise_max(maxima, name, value, older.max_steps.get(name, -1))
    return dataclasses.replace(newer, maxima={name: value for name, (value, _) in maxima.items()},
                               max_steps={name: step for name, (_, step) in maxima.items()})
