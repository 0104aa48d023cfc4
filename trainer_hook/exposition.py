"""Prometheus metric families for a published Snapshot (used by push and by pull mode)."""
from __future__ import annotations

import functools
from typing import Iterable, Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric, SummaryMetricFamily)
from prometheus_client.registry import CollectorRegistry

from .contract import DROP_REASONS, PREFIX, RUN_STATES, STEP_BUCKETS, Snapshot, per_key

#: Log keys with a documented meaning; any other numeric key is a plain gauge.
KNOWN_GAUGES = {
    "loss": "Training loss at the last logged step.",
    "learning_rate": "Learning rate at the last logged step (first parameter group with watch()).",
    "grad_norm": "Total L2 gradient norm at the last logged step.",
    "epoch": "Epoch at the last logged step.",
    "loss_scale": "Loss scale of the watched GradScaler after the last logged step.",
}


def _single(kind: type, name: str, doc: str, value: float, labels: dict[str, str]) -> Metric:
    """A family of `kind` with one sample."""
    family = kind(PREFIX + name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def families(snap: Snapshot, const: dict[str, str]) -> Iterator[Metric]:
    """Every training_* family for `snap`; `const` labels go on every sample (pull mode: run, rank)."""
    g = functools.partial(_single, GaugeMetricFamily, labels=const)
    c = functools.partial(_single, CounterMetricFamily, labels=const)
    yield g("step", "Step passed to the last log() call.", snap.step)
    for name, value in sorted(snap.gauges.items()):
        yield g(name, KNOWN_GAUGES.get(name, f"Last logged value of the {name!r} key."), value)
    for name, value in sorted(snap.maxima.items()):
        yield g(f"{name}_max", f"Largest finite {name} over the steps of the last max_hold seconds, at "
                "least since the previous push (NaN/Inf are counted in training_nonfinite_values_total).",
                value)
        yield g(f"{name}_max_step", f"Step at which training_{name}_max was seen.", snap.max_steps[name])
    summary = SummaryMetricFamily(PREFIX + "logged_value", "Finite logged values per key: "
                                  "rate(_sum)/rate(_count) is their exact mean over any range.",
                                  labels=[*const, "key"])
    nonfinite = CounterMetricFamily(PREFIX + "nonfinite_values", "NaN or infinite logged values per "
                                    "key (never in training_logged_value_sum).", labels=[*const, "key"])
    for key, total, count, bad in per_key(snap):
        summary.add_metric([*const.values(), key], count, total)
        nonfinite.add_metric([*const.values(), key], bad)
    yield summary
    yield nonfinite
    yield c("steps_total", "log() calls (training steps) so far.", snap.steps_total)
    yield c("samples_total", "Samples passed as samples= so far.", snap.samples_total)
    if snap.tokens_total is not None:
        yield c("tokens_total", "Tokens passed as tokens= so far.", snap.tokens_total)
    if snap.model_flops_total is not None:
        yield _single(CounterMetricFamily, "model_flops_total", "Model FLOPs of the steps so far "
                      "(flops_per_token x tokens, flops_per_sample x samples, or the estimate 6 x "
                      "parameters x tokens); precision: the peak FLOP/s the run's MFU divides by.",
                      snap.model_flops_total, {**const, "precision": snap.precision})
    hist = HistogramMetricFamily(PREFIX + "step_duration_seconds",
                                 "Wall time between consecutive log() calls.", labels=list(const))
    bounds = [str(b) for b in STEP_BUCKETS] + ["+Inf"]
    hist.add_metric(list(const.values()), list(zip(bounds, snap.bucket_counts)), snap.duration_sum)
    yield hist
    yield c("data_wait_seconds", "Time the training loop waited for its batches (loader(), "
            "log(data_wait=)).", snap.data_wait_seconds)
    yield c("nonfinite_steps", "Steps with a NaN or infinite logged value (not counting a "
            "GradScaler overflow).", snap.nonfinite_steps_total)
    yield g("first_nonfinite_step", "First step of the current (or latest) streak of non-finite "
            "steps; -1 until one happens.", snap.first_nonfinite_step)
    yield g("first_nonfinite_batch_id", "batch_id of training_first_nonfinite_step; -1 until one "
            "happens (or when not numeric).", snap.first_nonfinite_batch_id)
    yield g("last_nonfinite_step", "Step of the last non-finite value; -1 until one happens.",
            snap.last_nonfinite_step)
    yield g("last_nonfinite_batch_id", "batch_id of the last non-finite value; -1 until one happens.",
            snap.last_nonfinite_batch_id)
    skipped = CounterMetricFamily(PREFIX + "skipped_steps", "Optimizer steps the watched GradScaler "
                                  "skipped.", labels=[*const, "reason"])
    skipped.add_metric([*const.values(), "overflow"], snap.skipped_steps_total)
    yield skipped
    yield g("last_update_timestamp_seconds", "Unix time of the last log() call.", snap.last_update)
    yield g("start_timestamp_seconds", "Unix time the monitor was created.", snap.start_time)
    yield g("last_push_timestamp_seconds", "Unix time the hook published this state (every push "
            "interval, pushed, remote-written or served): what staleness rules compare with time().",
            snap.published)
    state = GaugeMetricFamily(PREFIX + "run_state", "1 for the run's current state.",
                              labels=[*const, "state"])
    for name in RUN_STATES:
        state.add_metric([*const.values(), name], float(name == snap.state))
    yield state
    if snap.state == "failed" and snap.failure_reason:
        yield _single(GaugeMetricFamily, "run_failure_info", "Why the run failed, value 1: the class of "
                      "the exception that ended it (or SIGTERM).", 1, {**const, "reason": snap.failure_reason})
    yield _single(GaugeMetricFamily, "run_info", "Hyper-parameters of the run as labels.", 1,
                  {**const, **snap.run_labels})
    if snap.gpus:
        info = GaugeMetricFamily(PREFIX + "gpu_info", "GPUs this rank trains on.",
                                 labels=[*const, "gpu", "uuid"])
        for gpu, uuid in snap.gpus:
            info.add_metric([*const.values(), gpu, uuid], 1)
        yield info
    yield g("local_rank", "Rank of this process on its node (picks the GPU).", snap.process.local_rank)
    yield g("world_size", "Processes in the run.", snap.process.world_size)
    yield _single(GaugeMetricFamily, "process_info", "The process that publishes these series (join "
                  "nvml_gpu_process_* on pid_namespace, and pid to their namespace_pid).", 1,
                  {**const, "pid": str(snap.process.pid), "hostname": snap.process.hostname,
                   "pid_namespace": snap.process.pid_namespace})
    dropped = CounterMetricFamily(PREFIX + "dropped_values", "Logged values that were not kept.",
                                  labels=[*const, "reason"])
    for reason in DROP_REASONS:
        dropped.add_metric([*const.values(), reason], snap.dropped.get(reason, 0))
    yield dropped
    yield c("push_failures", "Failed pushes to the Pushgateway, and remote-write requests or batches "
            "of samples that were dropped.", snap.push_failures)
    yield c("record_failures", "Failed writes to the local record file.", snap.record_failures)
    if snap.cuda is not None:
        yield g("cuda_memory_allocated_bytes", "CUDA caching allocator: allocated bytes.",
                snap.cuda["allocated"])
        yield g("cuda_memory_reserved_bytes", "CUDA caching allocator: reserved bytes.",
                snap.cuda["reserved"])
        yield c("cuda_alloc_retries", "CUDA allocator retries after a failed allocation.",
                snap.cuda["retries"])
        yield c("cuda_ooms", "CUDA out-of-memory errors raised by the allocator.", snap.cuda["ooms"])


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
