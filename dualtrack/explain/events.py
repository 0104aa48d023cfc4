"""Detection: a run's model-track events, found in its training_* series.

Each detector of DETECTORS reads the run through a Reader and returns its Events, without causes
(causes.py finds those). Where an alert watches the same thing, the detector evaluates the alert's
own condition (GRAD_SPIKE, LOSS_SCALE_COLLAPSE) or its numbers (dualtrack/thresholds.py), so that an
event and its alert agree.
"""
from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Callable, Iterator

from .. import thresholds as limits
from .model import Event, in_minutes
from .promql import seconds, window
from .reader import Reader

#: Numerics events: what the model computed went wrong.
NUMERICS = frozenset({"nonfinite", "grad_spike", "loss_scale_collapse"})
SLOWDOWNS = frozenset({"step_time_regression", "straggler"})
#: Events seen through a rate window, so late: their evidence may follow them (EVIDENCE_LAG).
SEEN_LATE = SLOWDOWNS | {"data_starvation"}
KINDS = NUMERICS | SLOWDOWNS | {"data_starvation", "oom", "failed", "replica_divergence"}

_NORM = "training_grad_norm_max{SEL}"
_SPIKE = f"max_over_time({_NORM}[{window(limits.GRAD_SPIKE_WINDOW)}])"
_MEDIAN_WINDOW = f"{_NORM}[{window(limits.GRAD_SPIKE_BASELINE)}] offset {window(limits.GRAD_SPIKE_WINDOW)}"
_MEDIAN = f"quantile_over_time({limits.GRAD_SPIKE_QUANTILE:g}, {_MEDIAN_WINDOW})"
#: TrainingGradientExplosion's own condition, so that an event and its alert agree (tests/dualtrack/test_explain.py
#: checks it against rules/alerts.yml; {SEL}: the run's matchers).
GRAD_SPIKE = f"""(
    {_SPIKE}
      > {limits.GRAD_SPIKE_FACTOR:g} * {_MEDIAN}
  and
    {_SPIKE} > {limits.GRAD_SPIKE_FLOOR:g}
  and
    {_SPIKE} < +Inf
  and
    count_over_time({_MEDIAN_WINDOW}) >= {limits.GRAD_SPIKE_HISTORY}
)"""
#: The spike's size, as TrainingGradientExplosion's description says it ("Nx its median over the 30 min
#: before"): one expression, evaluated by Prometheus for both (tests/dualtrack/test_explain.py checks the rule's).
GRAD_SPIKE_RATIO = f"{_SPIKE} / {_MEDIAN}"
#: TrainingLossScaleCollapse's first condition (tests/dualtrack/test_explain.py checks it against the rule), and
#: the maximum it compares with.
LOSS_SCALE_PEAK = f"max_over_time(training_loss_scale{{SEL}}[{window(limits.LOSS_SCALE_WINDOW)}])"
LOSS_SCALE_COLLAPSE = f"training_loss_scale{{SEL}} < {LOSS_SCALE_PEAK} / {limits.LOSS_SCALE_COLLAPSE:g}"

#: A per-rank hit: (time, rank, step, detail).
Hit = tuple[float, str, int | None, str]


def find_events(reader: Reader) -> list[Event]:
    """Every event of the run in time order (at the same time by step: a cause before its effect)."""
    events = [event for detect in DETECTORS for event in detect(reader)]
    return sorted(events, key=lambda e: (e.time, e.step if e.step is not None else math.inf, e.kind))


def _group(hits: list[Hit], kind: str, tolerance: float) -> list[Event]:
    """Per-rank hits -> events: hits at the same step (or close in time) are one event whose rank is
    the first affected (lowest step, then earliest)."""
    hits.sort(key=lambda h: (h[0], h[2] if h[2] is not None else 0))
    events: list[Event] = []
    for at, rank, step, detail in hits:
        for event in events:
            same = step is not None and event.step is not None and abs(step - event.step) <= 1
            if same or abs(at - event.time) <= tolerance:
                if rank != event.rank and rank not in event.others:
                    event.others.append(rank)
                break
        else:
            events.append(Event(kind, step, at, rank, None, detail))
    return events


def nonfinite_events(reader: Reader) -> list[Event]:
    """The first step of each non-finite streak (training_first_nonfinite_step takes a new value)."""
    hits: list[Hit] = []
    for rank, values in reader.by_rank(reader.select("training_first_nonfinite_step")).items():
        seen = -1.0  # the series' value before any non-finite step
        for at, value in values:
            if value >= 0 and value != seen:
                at = reader.refine(f"{reader.select('training_first_nonfinite_step', rank=rank)} == {value!r}", at)
                keys = _nonfinite_keys(reader, rank, at)
                hits.append((step_time(reader, rank, int(value), at), rank, int(value), keys + " non-finite"))
            seen = value
    return _group(hits, "nonfinite", limits.NEAR_POINTS * reader.res)


def _nonfinite_keys(reader: Reader, rank: str, at: float) -> str:
    """The logged keys that went non-finite at `at` ("loss", "loss, grad_norm"), else "values"."""
    counted = reader.select("training_nonfinite_values_total", rank=rank)
    found = reader.client.query(f"increase({counted}[{seconds(limits.NEAR_POINTS * reader.res)}]) > 0",
                                at + reader.res)
    return ", ".join(sorted({s["metric"].get("key", "?") for s in found})) or "values"


def grad_spikes(reader: Reader) -> list[Event]:
    """Where TrainingGradientExplosion's condition holds (GRAD_SPIKE): one event per spike and rank, at
    the first second it holds, its size GRAD_SPIKE_RATIO there (what the alert's description says)."""
    hits: list[Hit] = []
    spike = window(limits.GRAD_SPIKE_WINDOW)
    for rank, values in reader.by_rank(reader.fill(GRAD_SPIKE)).items():
        norms = reader.select("training_grad_norm_max", rank=rank)
        steps = reader.select("training_grad_norm_max_step", rank=rank)
        last_hit = -math.inf
        for at, value in values:
            if at - last_hit > limits.SPIKE_SEPARATION:
                at = reader.refine(reader.fill(GRAD_SPIKE, rank=rank), at)
                ratio = reader.instant(reader.fill(GRAD_SPIKE_RATIO, rank=rank), at)
                # The largest norm of the spike's window, and the step that logged it.
                norm = reader.instant(f"max_over_time({norms}[{spike}])", at)
                found = reader.instant(f"max_over_time(({steps} and on (job, run, rank, instance) {norms} >= {norm!r})"
                                       f"[{spike}:])", at) if norm is not None else None
                step = int(found) if found is not None else None
                size = (f", {ratio:.3g}x its median over the {in_minutes(limits.GRAD_SPIKE_BASELINE)} before"
                        if ratio is not None else "")
                hits.append((step_time(reader, rank, step, at) if step is not None else at, rank, step,
                             f"gradient norm {norm if norm is not None else value:.3g}{size}"))
            last_hit = at
    return _group(hits, "grad_spike", limits.NEAR_POINTS * reader.res)


def step_time(reader: Reader, rank: str, step: int, seen: float) -> float:
    """When the rank logged `step`, by its own clock: between the pushes before and at `seen` (the first
    sample that showed it), the time of its last update interpolated on the steps. `seen` when unknown."""
    names = ("training_step", "training_last_update_timestamp_seconds")
    pairs: dict[float, dict[str, float]] = {}
    for name in names:
        for series in reader.client.query(f"{reader.select(name, rank=rank)}[{reader.recent()}]", seen)[:1]:
            for at, value in series["values"]:
                pairs.setdefault(float(at), {})[name] = float(value)
    logs = sorted((p[names[0]], p[names[1]]) for p in pairs.values() if len(p) == len(names))
    after = next((i for i, (logged, _) in enumerate(logs) if logged >= step), None)
    if after is None:
        return seen
    logged, update = logs[after]
    if after == 0 or logged == step:
        return min(seen, update)
    before, then = logs[after - 1]
    return min(seen, then + (update - then) * (step - before) / (logged - before))


def _sustained(times: list[float], bad: list[bool], start: int, duration: float) -> int | None:
    """Index of the first point at or after `start` from which `bad` holds for `duration` seconds."""
    i = start
    while i < len(times):
        if bad[i]:
            j = i
            while j < len(times) and bad[j]:
                if times[j] - times[i] >= duration:
                    return i
                j += 1
            i = j
        i += 1
    return None


def _episodes(times: list[float], onset: list[bool], held: list[bool], duration: float) -> Iterator[tuple[int, int]]:
    """(first, end) indices of each episode: `onset` holds from `first` for `duration` seconds, and the
    episode lasts while `held` holds (`end`: the first point where it no longer does)."""
    i = 0
    while (first := _sustained(times, onset, i, duration)) is not None:
        end = first
        while end < len(times) and held[end]:
            end += 1
        yield first, end
        i = end


def _rate_window(reader: Reader, least: float) -> str:
    """A rate window of `least` seconds, at least RATE_POINTS points at coarse resolution."""
    return seconds(max(least, limits.RATE_POINTS * reader.res))


def slowdowns(reader: Reader) -> list[Event]:
    """step_time_regression (the run's median step time up REGRESSION_RATIO on the REGRESSION_BASELINE
    before, for REGRESSION_FOR) and straggler (TrainingStragglerRank's condition: a rank below
    STRAGGLER_SHARE of the run's median step rate for STRAGGLER_FOR); dualtrack/thresholds.py's numbers."""
    rates = reader.by_rank(f"rate({reader.select('training_steps_total')}[{_rate_window(reader, limits.RATE_WINDOW)}])")
    by_time: dict[float, dict[str, float]] = {}
    for rank, values in rates.items():
        for at, value in values:
            by_time.setdefault(at, {})[rank] = value
    # Ranks that stopped stepping (failed, finished) are not slow ranks: the median is of the others.
    times = sorted(t for t, ranks in by_time.items() if any(v > 0 for v in ranks.values()))
    median = [(t, statistics.median(v for v in by_time[t].values() if v > 0)) for t in times]
    events: list[Event] = []
    seconds_per_step = [(t, 1 / r if r > 0 else math.inf) for t, r in median]
    baseline: list[float] = []
    for i, (at, _) in enumerate(seconds_per_step):
        first = bisect.bisect_left(times, at - limits.REGRESSION_BASELINE)
        prior = [s for _, s in seconds_per_step[first:i] if math.isfinite(s)]
        baseline.append(statistics.median(prior) if len(prior) >= limits.REGRESSION_HISTORY else math.nan)
    slow = [math.isfinite(s) and s >= limits.REGRESSION_RATIO * b
            for (_, s), b in zip(seconds_per_step, baseline, strict=True)]
    i = 0
    while (found := _sustained(times, slow, i, limits.REGRESSION_FOR)) is not None:
        at, before = seconds_per_step[found][0], baseline[found]
        k = found
        while k < len(seconds_per_step) and seconds_per_step[k][1] > limits.REGRESSION_RECOVERED * before:
            k += 1
        settled = statistics.median(s for _, s in seconds_per_step[found:k])
        events.append(Event("step_time_regression", reader.step_at(None, at), at, None, None,
                            f"step time rose from {before:.3g} s to {settled:.3g} s (x{settled / before:.2f})"))
        i = k
    if len(rates) > 1:
        medians = dict(median)
        for rank, values in rates.items():
            share = [(t, v / medians[t] if medians.get(t) else 1.0) for t, v in values]
            slow = [s < limits.STRAGGLER_SHARE and v > 0 for (_, s), (_, v) in zip(share, values, strict=True)]
            events += _stragglers(reader, rank, share, slow, [s < limits.STRAGGLER_RECOVERED for _, s in share],
                                  limits.STRAGGLER_FOR, "stepped at {:.0%} of the run's median rate")
    return events


def _stragglers(reader: Reader, rank: str, shares: list[tuple[float, float]], onset: list[bool], held: list[bool],
                duration: float, detail: str) -> list[Event]:
    """A straggler event per episode of the rank's `shares` (_episodes), `detail` saying the episode's median."""
    events = []
    for found, end in _episodes([t for t, _ in shares], onset, held, duration):
        at = shares[found][0]
        middle = statistics.median(share for _, share in shares[found:end])
        events.append(Event("straggler", reader.step_at(rank, at), at, rank, None, detail.format(middle)))
    return events


def lockstep_stragglers(reader: Reader) -> list[Event]:
    """straggler under synchronous data parallelism (TrainingStragglerRank's collective-wait rule): a
    rank whose share of step time spent waiting in the collectives is STRAGGLER_WAIT_GAP or more below
    the run's largest, for STRAGGLER_WAIT_FOR seconds (dualtrack/thresholds.py). The ranks step at one
    pace there, so the step-rate straggler of slowdowns() cannot see it: the others wait for it."""
    rng = _rate_window(reader, limits.STRAGGLER_WAIT_WINDOW)
    shares = reader.by_rank(f"rate({reader.select('training_collective_wait_seconds_total')}[{rng}]) "
                            f"/ rate({reader.select('training_step_duration_seconds_sum')}[{rng}])")
    by_time: dict[float, dict[str, float]] = {}
    for rank, values in shares.items():
        for at, value in values:
            if math.isfinite(value):
                by_time.setdefault(at, {})[rank] = value
    events: list[Event] = []
    for rank, values in shares.items():
        gap = [(at, max(by_time[at].values()) - value) for at, value in values
               if math.isfinite(value) and len(by_time[at]) > 1]
        events += _stragglers(reader, rank, gap, [g >= limits.STRAGGLER_WAIT_GAP for _, g in gap],
                              [g >= limits.STRAGGLER_WAIT_RECOVERED for _, g in gap], limits.STRAGGLER_WAIT_FOR,
                              "the other ranks waited for it in the collectives ({:.0%} of each step)")
    return events


def starvation(reader: Reader) -> list[Event]:
    """A rank that waited for batches more than STARVATION_SHARE of the time (over RATE_WINDOW) for
    STARVATION_FOR seconds (dualtrack/thresholds.py): TrainingDataLoaderBottleneck's condition."""
    rng = seconds(max(limits.RATE_WINDOW, reader.res))
    hits: list[Hit] = []
    for rank, values in reader.by_rank(f"rate({reader.select('training_data_wait_seconds_total')}[{rng}])").items():
        for found, _ in _episodes([t for t, _ in values], [v > limits.STARVATION_SHARE for _, v in values],
                                  [v > limits.STARVATION_RECOVERED for _, v in values], limits.STARVATION_FOR):
            at = values[found][0]
            hits.append((at, rank, reader.step_at(rank, at), "steps starved of data"))
    return _group(hits, "data_starvation", limits.EVIDENCE_WINDOW)


def loss_scale_collapses(reader: Reader) -> list[Event]:
    """Where TrainingLossScaleCollapse's condition (LOSS_SCALE_COLLAPSE: the loss scale below
    1 / LOSS_SCALE_COLLAPSE of its maximum over the LOSS_SCALE_WINDOW before) starts to hold: one event
    per collapse and rank, with that maximum. Prometheus answers only the points where it holds."""
    hits: list[Hit] = []
    for rank, values in reader.by_rank(reader.fill(LOSS_SCALE_COLLAPSE)).items():
        previous = -1
        for at, value in values:
            point = round((at - reader.start) / reader.res)
            if point != previous + 1:  # it did not hold at the point before: a collapse starts
                top = reader.instant(reader.fill(LOSS_SCALE_PEAK, rank=rank), at)
                hits.append((at, rank, reader.step_at(rank, at),
                             f"loss scale fell from {top if top is not None else value:g} to {value:g}"))
            previous = point
    return _group(hits, "loss_scale_collapse", limits.NEAR_POINTS * reader.res)


def ooms(reader: Reader) -> list[Event]:
    """oom: the allocator counted an out-of-memory error."""
    hits: list[Hit] = []
    for rank, values in reader.by_rank(reader.select("training_cuda_ooms_total")).items():
        for (_, before), (at, value) in itertools.pairwise(values):
            if value > before:
                hits.append((at, rank, reader.step_at(rank, at), "CUDA out of memory"))
                break
    return _group(hits, "oom", limits.MERGE_WINDOW)


def failures(reader: Reader) -> list[Event]:
    """failed: the run state became failed."""
    hits: list[Hit] = []
    for rank, values in reader.by_rank(reader.select("training_run_state", state="failed")).items():
        failed = next((t for t, v in values if v == 1), None)
        if failed is not None:
            hits.append((failed, rank, reader.step_at(rank, failed), "failed"))
    return _group(hits, "failed", limits.MERGE_WINDOW)


def replica_divergences(reader: Reader) -> list[Event]:
    """replica_divergence: the first time a data-parallel rank's post-reduction grad norm was not its
    peers' (training_replica_divergent_steps_total grew; TrainingReplicaDivergence's condition)."""
    hits: list[Hit] = []
    for rank, values in reader.by_rank(reader.select("training_replica_divergent_steps_total")).items():
        diverged = next((t for t, v in values if v > 0), None)
        if diverged is not None:
            hits.append((diverged, rank, reader.step_at(rank, diverged),
                         "post-reduction gradient norm differs from its data-parallel peers' (a corrupted replica)"))
    return _group(hits, "replica_divergence", limits.MERGE_WINDOW)


#: The detectors, in the order their events are listed when they tie (same time, step and kind).
DETECTORS: tuple[Callable[[Reader], list[Event]], ...] = (
    nonfinite_events, grad_spikes, slowdowns, lockstep_stragglers, starvation, loss_scale_collapses, ooms,
    failures, replica_divergences)
