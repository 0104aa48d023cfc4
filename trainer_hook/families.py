"""prometheus_client metric families for a published Snapshot (used by push, pull mode and remote write): one
per series declared in contract.SERIES, with its declared type, HELP and labels, then the logged keys' gauges."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import CollectorRegistry

from .contract import (
    DROP_REASONS,
    PHASES,
    PREFIX,
    RUN_STATES,
    SERIES,
    SKIP_REASON,
    STEP_BUCKETS,
    WINDOW_MAX_KEYS,
    Series,
    Snapshot,
    logged_series,
    per_key,
)

_KINDS: dict[str, type] = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
                           "summary": SummaryMetricFamily, "histogram": HistogramMetricFamily}
#: A series' rows: (its label values, the arguments of add_metric after them); None: not exported.
Rows = list[tuple[tuple[str, ...], tuple[Any, ...]]] | None
_BOUNDS = [str(b) for b in STEP_BUCKETS] + ["+Inf"]


def _one(value: float) -> Rows:
    return [((), (value,))]


def _maxima(snap: Snapshot, name: str) -> Rows:
    key = name[:-len("_max")]
    return _one(snap.maxima[key]) if key in snap.maxima else None


def _max_step(snap: Snapshot, name: str) -> Rows:
    key = name[:-len("_max_step")]
    return _one(snap.max_steps[key]) if key in snap.maxima else None


def _cuda(field: str) -> Callable[[Snapshot, str], Rows]:
    return lambda snap, _: None if snap.cuda is None else _one(snap.cuda[field])


def _timed(attribute: str) -> Callable[[Snapshot, str], Rows]:
    """A series of the timed collectives: none where they are not timed."""
    return lambda snap, _: None if snap.collective_wait is None else _one(getattr(snap, attribute))


def _attribute(attribute: str) -> Callable[[Snapshot, str], Rows]:
    return lambda snap, _: _one(getattr(snap, attribute))


#: How each declared series (contract.SERIES) reads a snapshot: (snapshot, series name) -> rows
#: (training_run_info, whose labels are the config's, is written by families()).
_ROWS: dict[str, Callable[[Snapshot, str], Rows]] = {
    **{f"{key}_max": _maxima for key in WINDOW_MAX_KEYS},
    **{f"{key}_max_step": _max_step for key in WINDOW_MAX_KEYS},
    **{name: _attribute(name) for name in ("step", "first_nonfinite_step", "first_nonfinite_batch_id",
                                           "last_nonfinite_step", "last_nonfinite_batch_id")},
    "logged_value": lambda snap, _: [((key,), (count, total)) for key, total, count, _bad in per_key(snap)],
    "nonfinite_values": lambda snap, _: [((key,), (bad,)) for key, _total, _count, bad in per_key(snap)],
    "steps": _attribute("steps_total"),
    "samples": _attribute("samples_total"),
    "tokens": lambda snap, _: None if snap.tokens_total is None else _one(snap.tokens_total),
    "model_flops": lambda snap, _: (None if snap.model_flops_total is None
                                    else [((snap.precision,), (snap.model_flops_total,))]),
    "step_duration_seconds": lambda snap, _: [((), (list(zip(_BOUNDS, snap.bucket_counts)),
                                                    snap.duration_sum))],
    "data_wait_seconds": _attribute("data_wait_seconds"),
    "nonfinite_steps": _attribute("nonfinite_steps_total"),
    "skipped_steps": lambda snap, _: [((SKIP_REASON,), (snap.skipped_steps_total,))],
    "paused_seconds": lambda snap, _: [((reason,), (seconds,)) for reason, seconds in
                                       sorted(snap.paused_seconds.items())] or None,
    "pause_start_timestamp_seconds": lambda snap, _: None if snap.pause is None else [((snap.pause[0],),
                                                                                      (snap.pause[1],))],
    "replica_compared_steps": lambda snap, _: None if snap.replica is None else _one(snap.replica[0]),
    "replica_divergent_steps": lambda snap, _: None if snap.replica is None else _one(snap.replica[1]),
    "last_update_timestamp_seconds": _attribute("last_update"),
    "start_timestamp_seconds": _attribute("start_time"),
    "last_push_timestamp_seconds": _attribute("published"),
    "run_state": lambda snap, _: [((name,), (float(name == snap.state),)) for name in RUN_STATES],
    "run_failure_info": lambda snap, _: ([((snap.failure_reason,), (1,))]
                                         if snap.state == "failed" and snap.failure_reason else None),
    "gpu_info": lambda snap, _: [((gpu, uuid), (1,)) for gpu, uuid in snap.gpus] or None,
    "local_rank": lambda snap, _: _one(snap.process.local_rank),
    "world_size": lambda snap, _: _one(snap.process.world_size),
    "process_info": lambda snap, _: [((str(snap.process.pid), snap.process.hostname,
                                       snap.process.pid_namespace, snap.process.start_time), (1,))],
    "launch_info": lambda snap, _: [((snap.process.launch,), (1,))] if snap.process.launch else None,
    "dropped_values": lambda snap, _: [((reason,), (snap.dropped.get(reason, 0),)) for reason in DROP_REASONS],
    "push_failures": _attribute("push_failures"),
    "record_failures": _attribute("record_failures"),
    "cuda_memory_allocated_bytes": _cuda("allocated"),
    "cuda_memory_reserved_bytes": _cuda("reserved"),
    "cuda_alloc_retries": _cuda("retries"),
    "cuda_ooms": _cuda("ooms"),
    **{name: _timed(attribute) for name, attribute in (
        ("collective_wait_seconds", "collective_wait"), ("compute_seconds", "compute"),
        ("collectives", "collectives_total"), ("collective_sequence", "collective_sequence"))},
    "rank_phase": lambda snap, _: [((name,), (float(name == snap.phase),)) for name in PHASES],
    "rank_frame_info": lambda snap, _: [((snap.frame,), (1,))] if snap.frame else None,
}


def _family(series: Series, const: dict[str, str], rows: Rows, extra: tuple[str, ...] = ()) -> Metric:
    """The family of a declared `series` with `rows`; `extra` label names follow the declared ones."""
    family = _KINDS[series.type](PREFIX + series.name, series.help, labels=[*const, *series.labels, *extra])
    for labels, arguments in rows or ():
        family.add_metric([*const.values(), *labels], *arguments)
    return family


def families(snap: Snapshot, const: dict[str, str]) -> Iterator[Metric]:
    """Every training_* family for `snap` (contract.SERIES, then the logged keys' gauges); `const`
    labels go on every sample (pull mode: run, rank)."""
    for series in SERIES:
        if series.name == "run_info":
            yield _family(series, const, [(tuple(snap.run_labels.values()), (1,))], tuple(snap.run_labels))
            continue
        rows = _ROWS[series.name](snap, series.name)
        if rows is not None:
            yield _family(series, const, rows)
    for name, value in sorted(snap.gauges.items()):
        yield _family(logged_series(name), const, _one(value))


class SnapshotCollector:
    """A prometheus_client collector over whatever snapshot `source()` returns at collect time."""

    def __init__(self, source, const: dict[str, str]) -> None:
        self._source = source
        self._const = const

    def collect(self) -> Iterable[Metric]:
        return families(self._source(), self._const)


def registry_for(source, const: dict[str, str] | None = None) -> CollectorRegistry:
    """A dedicated registry (no process/GC collectors) exposing `source()`'s snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(source, const or {}))
    return registry
