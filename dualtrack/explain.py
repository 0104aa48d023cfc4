"""`dualtrack explain RUN`: the run's model-track events, each with the infra evidence found before it.

Events come from the run's `training_*` series; evidence from the `nvml_gpu_*` series of the GPUs
the run trained on (`training_gpu_info` joins rank to GPU uuid; a rank on a MIG instance is joined to
its parent GPU by the recorded `job_run_rank_gpu:training_gpu_info:nvml`) in a window before each event.
`timeline(client, run, since, until)` is the logic; `dualtrack report` shows the same timeline.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from exporter import xids
from trainer_hook.text import one_line

from . import prometheus
from . import thresholds as limits
from .summary import utc
from .console import duration, fail, warner

HELP = "explain a run: its model-track events (NaN, slowdowns, stragglers, OOM...) and the GPU evidence before each"
warn = warner("explain")
#: Evidence is looked for in this window before an event (seconds).
WINDOW = limits.EVIDENCE_WINDOW
#: At most this many points per series in a range query over the whole run.
MAX_POINTS = 1500
#: TrainingGradientExplosion's own condition, so that an event and its alert agree (tests/dualtrack/test_explain.py
#: checks it against rules/alerts.yml; SEL: the run's matchers).
GRAD_SPIKE = """(
    max_over_time(training_grad_norm_max{SEL}[2m])
      > 10 * quantile_over_time(0.5, training_grad_norm_max{SEL}[30m] offset 2m)
  and
    max_over_time(training_grad_norm_max{SEL}[2m]) > 1e-4
  and
    max_over_time(training_grad_norm_max{SEL}[2m]) < +Inf
  and
    count_over_time(training_grad_norm_max{SEL}[30m] offset 2m) >= 5
)"""
#: The spike's size, as TrainingGradientExplosion's description says it ("Nx its median over the 30 min
#: before"): one expression, evaluated by Prometheus for both (tests/dualtrack/test_explain.py checks the rule's).
GRAD_SPIKE_RATIO = ("max_over_time(training_grad_norm_max{SEL}[2m]) / "
                    "quantile_over_time(0.5, training_grad_norm_max{SEL}[30m] offset 2m)")
#: Hyper-parameters whose change at or just before a numerics event is a cause: name -> series, the
#: first the hook exports (a learning rate's window maximum shows a jump that a rollback undid in the push).
HYPER_PARAMETERS = {"learning_rate": ("training_learning_rate_max", "training_learning_rate"),
                    "loss_scale": ("training_loss_scale",), "batch_size": ("training_batch_size",)}
DEFAULT_LOOKBACK = 7 * 86400.0
THROTTLE_KINDS = {"thermal_throttle": ("sw_thermal_slowdown", "hw_thermal_slowdown"),
                  "power_throttle": ("sw_power_cap", "hw_power_brake_slowdown"),
                  "hw_slowdown": ("hw_slowdown",)}
HARDWARE = {"gpu_lost", "xid", "ecc", "remapped_rows", "thermal_throttle", "power_throttle", "hw_slowdown",
            "clock_drop", "link_drop"}
PROCESS_MEMORY = "nvml_gpu_process_memory_used_bytes"
PROCESS_SM = "nvml_gpu_process_sm_utilization_ratio"
#: The causes that can explain each kind of event (nothing else is looked for, so nothing is invented).
RELEVANT = {
    "nonfinite": {"gpu_lost", "xid", "ecc", "remapped_rows", "hyperparameter"},
    "grad_spike": {"gpu_lost", "xid", "ecc", "remapped_rows", "hyperparameter"},
    "loss_scale_collapse": {"gpu_lost", "xid", "ecc", "remapped_rows", "hyperparameter"},
    "step_time_regression": HARDWARE | {"co_tenant", "memory_pressure", "data_wait"},
    "straggler": HARDWARE | {"co_tenant", "memory_pressure", "data_wait"},
    "data_starvation": {"data_wait"},
    "oom": {"memory_pressure", "co_tenant", "gpu_lost", "xid"},
    "replica_divergence": {"gpu_lost", "xid", "ecc", "remapped_rows"},
    "failed": {"gpu_lost", "xid", "ecc", "remapped_rows", "memory_pressure", "co_tenant", "link_drop"},
}
VERDICT = {"co_tenant": "another process on the GPU, not the model",
           "memory_pressure": "GPU memory, not the model's numerics",
           "data_wait": "the input pipeline, not the GPU or the model",
           "hyperparameter": "a hyper-parameter change, not the GPU"}


class ExplainError(Exception):
    """The run cannot be explained (not found); one line."""


@dataclass
class Cause:
    kind: str
    evidence: str
    score: float
    phrase: str = field(default="", repr=False)  # short form for the event's sentence


@dataclass
class Event:
    kind: str
    step: int | None
    time: float
    rank: str | None
    gpu_uuid: str | None
    detail: str
    others: list[str] = field(default_factory=list)  # other ranks affected
    causes: list[Cause] = field(default_factory=list)
    sentence: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "time": self.time, "rank": self.rank,
                "gpu_uuid": self.gpu_uuid, "other_ranks": self.others, "sentence": self.sentence,
                "causes": [{k: v for k, v in asdict(c).items() if k != "phrase"} for c in self.causes]}


@dataclass
class Timeline:
    run: str
    job: str
    start: float
    end: float
    gpus: dict[str, str]  # rank -> uuid
    events: list[Event]
    parent_gpus: dict[str, str] = field(default_factory=dict)  # rank on a MIG instance -> its parent GPU's uuid
    launch: str | None = None  # the launch explained (None: the run names none)
    other_launches: list[dict[str, Any]] = field(default_factory=list)  # {"launch", "start"} of the others

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "job": self.job, "start": self.start, "end": self.end,
                "gpus": self.gpus, "parent_gpus": self.parent_gpus, "launch": self.launch,
                "other_launches": self.other_launches, "events": [e.to_json() for e in self.events]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="RUN", help="the run id (the `run` label of its training_* series)")
    prometheus.add_arguments(parser, "where the run's training and GPU series are")
    parser.add_argument("--since", metavar="TIME", default=None,
                        help="look for the run from TIME: unix seconds, ISO 8601 (2026-12-03T10:00:00Z) "
                             "or a duration ago (90m, 6h, 2d); default 7 days before --until")
    parser.add_argument("--until", metavar="TIME", default=None, help="... up to TIME (default: now)")
    parser.add_argument("--launch", metavar="ID", default=None,
                        help="the launch to explain when the run id was launched more than once (default: the "
                             "latest in the window; the others are listed)")
    parser.add_argument("--json", action="store_true", help="print the timeline as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        now = time.time()
        until = parse_time(args.until, now, "--until") if args.until else now
        since = parse_time(args.since, now, "--since") if args.since else until - DEFAULT_LOOKBACK
        if since >= until:
            raise ValueError("--since must be before --until")
        client = prometheus.from_args(args, warn)
    except ValueError as exc:
        return fail("explain", str(exc), 2)
    if client is None:
        return fail("explain", f"no Prometheus: pass --prometheus URL or set ${prometheus.ENV_URL}", 2)
    try:
        found = timeline(client, args.run_id, since, until, args.launch)
    except ExplainError as exc:
        return fail("explain", str(exc))
    except prometheus.QueryError as exc:
        return fail("explain", f"{client.url}: {exc}")
    print(json.dumps(found.to_json(), indent=1) if args.json else render_text(found))
    return 0


def parse_time(text: str, now: float, flag: str) -> float:
    """Unix seconds, ISO 8601, or a duration ago (30s, 90m, 6h, 2d); finite. Raises ValueError."""
    found = _parse_time(text, now, flag)
    if not math.isfinite(found):
        raise ValueError(f"{flag} {text!r}: not a finite time")
    return found


def _parse_time(text: str, now: float, flag: str) -> float:
    if text.strip()[-1:].isalpha():  # a duration with its unit (6h): that long ago; else ISO 8601 (...Z)
        try:
            return now - duration(text)
        except argparse.ArgumentTypeError:
            pass
    try:
        return float(text)
    except ValueError:
        pass
    try:
        # Python 3.10's fromisoformat does not read the "Z" of UTC.
        parsed = datetime.fromisoformat(re.sub(r"[zZ]$", "+00:00", text.strip()))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: not unix seconds, ISO 8601 or a duration like 6h") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def _values(series: dict[str, Any]) -> list[tuple[float, float]]:
    return [(float(t), float(v)) for t, v in series["values"]]


class Reader:
    """The queries of one explanation: the run's selector, its extent and resolution."""

    def __init__(self, client: prometheus.Prometheus, run: str, since: float, until: float) -> None:
        self.client = client
        self.selector = f"run={prometheus.quote(run)}"
        span = max(60.0, until - since)
        rng = f"{int(span)}s"
        starts = client.query(f"min(min_over_time(training_start_timestamp_seconds{{{self.selector}}}[{rng}]))", until)
        # 0 until a step is logged: no end yet
        ends = client.query(f"max(max_over_time(training_last_update_timestamp_seconds{{{self.selector}}}[{rng}]) > 0)",
                            until)
        jobs = client.query(f"count by (job, rank) (last_over_time(training_step{{{self.selector}}}[{rng}]))", until)
        if not jobs:
            raise ExplainError(f"run {run!r}: no training_step series between {utc(since)} and {utc(until)} "
                               "(check the run id, --since and --until)")
        self.job = jobs[0]["metric"].get("job", "")
        self.ranks = sorted({s["metric"].get("rank", "") for s in jobs}, key=_rank_key)
        first, last = (float(found[0]["value"][1]) if found else math.nan for found in (starts, ends))
        self.start = max(since, first) if math.isfinite(first) else since
        self.end = min(until, last + 60) if math.isfinite(last) else until
        self.res = max(15.0, math.ceil((self.end - self.start) / MAX_POINTS))
        # Range queries step from start: the last point must be the end (what happened last counts).
        self.start = self.end - math.ceil((self.end - self.start) / self.res) * self.res
        info = client.query(f"max by (rank, uuid) (last_over_time(training_gpu_info{{{self.selector}}}[{rng}]))", until)
        self.gpus = {s["metric"].get("rank", ""): s["metric"]["uuid"] for s in info if "uuid" in s["metric"]}
        # The uuid of each rank's GPU in the exporter's series: a MIG instance's parent GPU.
        joined = client.query("max by (rank, uuid, gpu_instance) (last_over_time("
                              f"job_run_rank_gpu:training_gpu_info:nvml{{{self.selector},mig_uuid!=\"\"}}[{rng}]))", until)
        self.parents = {s["metric"].get("rank", ""): s["metric"]["uuid"] for s in joined if "uuid" in s["metric"]}
        self.instances = {s["metric"].get("rank", ""): s["metric"].get("gpu_instance", "") for s in joined}
        self.exporter_gpus = {rank: self.parents.get(rank, uuid) for rank, uuid in self.gpus.items()}

    def by_rank(self, expr: str) -> dict[str, list[tuple[float, float]]]:
        """`expr` (with SEL for the run's label matchers) over the run, one value list per rank."""
        found = self.client.query_range(expr.replace("SEL", self.selector), self.start, self.end, self.res)
        out: dict[str, list[tuple[float, float]]] = {}
        for series in found:
            out.setdefault(series["metric"].get("rank", ""), []).extend(_values(series))
        return out

    def step_at(self, rank: str | None, at: float) -> int | None:
        """The run's (the rank's) training_step at `at`."""
        sel = self.selector + (f",rank={prometheus.quote(rank)}" if rank is not None else "")
        found = self.client.query(f"max(last_over_time(training_step{{{sel}}}[{int(self.res * 2 + 300)}s]))", at)
        return int(float(found[0]["value"][1])) if found else None


def timeline(client: prometheus.Prometheus, run: str, since: float, until: float,
             launch: str | None = None) -> Timeline:
    """Every event of the run (of its latest launch in the window, or of `launch`) with its ranked
    causes, in time order (a cause's event at the same time before its effect's: by step). Raises
    ExplainError, prometheus.QueryError."""
    found = launches(client, run, since, until)
    chosen = None
    if found:
        if launch is not None and launch not in found:
            raise ExplainError(f"run {run!r}: no launch {launch!r} between {utc(since)} and {utc(until)} "
                               f"(launches: {', '.join(found)})")
        chosen = launch if launch is not None else max(found, key=lambda name: (found[name], name))
        seen = found[chosen][1]
        later = [first for first in (f for _, f in found.values()) if first > seen]
        since, until = max(since, seen), min([until, *(first - 1 for first in later)])
    reader = Reader(client, run, since, until)
    events = (nonfinite_events(reader) + grad_spikes(reader) + slowdowns(reader) + lockstep_stragglers(reader)
              + starvation(reader) + loss_scale_collapses(reader) + ends(reader) + replica_divergences(reader))
    events.sort(key=lambda e: (e.time, e.step if e.step is not None else math.inf, e.kind))
    for event in events:
        event.gpu_uuid = reader.gpus.get(event.rank) if event.rank is not None else None
        event.causes = find_causes(reader, event)
        event.sentence = sentence(event, len(reader.ranks), bool(reader.gpus))
    others = [{"launch": name, "start": start} for name, (start, _) in sorted(found.items(), key=lambda x: x[1])
              if name != chosen]
    return Timeline(run, reader.job, reader.start, reader.end, reader.gpus, events, reader.parents, chosen, others)


def launches(client: prometheus.Prometheus, run: str, since: float, until: float) -> dict[str, tuple[float, float]]:
    """The run's launches in the window: launch id -> (its start, when Prometheus first had it). A hook
    that names no launch (training_launch_info) has one per start time, named as `dualtrack report`
    names them. Each launch's series take over the same labels as the one before it: what is before a
    launch's first sample is the previous launch's."""
    from .records import LAUNCH_TIME_FORMAT
    sel = f"run={prometheus.quote(run)}"
    step = max(1.0, math.ceil((until - since) / MAX_POINTS))
    rng = f"{int(step)}s"
    starts = dict(_values(found[0])) if (found := client.query_range(
        f"min(max_over_time(training_start_timestamp_seconds{{{sel}}}[{rng}]))", since, until, step)) else {}
    found: dict[str, tuple[float, float]] = {}
    for series in client.query_range(f"max by (launch) (last_over_time(training_launch_info{{{sel}}}[{rng}]))",
                                     since, until, step):
        first = series["values"][0][0]
        found[series["metric"].get("launch", "")] = (starts.get(first, first), first)
    unnamed = client.query_range(f"min(max_over_time(training_start_timestamp_seconds{{{sel}}}[{rng}]) unless on (job, "
                                 f"run, rank, instance) last_over_time(training_launch_info{{{sel}}}[{rng}]))",
                                 since, until, step)
    for at, value in _values(unnamed[0]) if unnamed else []:
        found.setdefault(time.strftime(LAUNCH_TIME_FORMAT, time.gmtime(value)), (value, at))
    return found


def _rank_key(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 30, rank)


def _group(hits: list[tuple[float, str, int | None, str]], kind: str, tolerance: float) -> list[Event]:
    """Per-rank hits (time, rank, step, detail) -> events: hits at the same step (or close in time)
    are one event whose rank is the first affected (lowest step, then earliest)."""
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
    hits = []
    for rank, values in reader.by_rank("training_first_nonfinite_step{SEL}").items():
        seen = -1.0
        for at, value in values:
            if value >= 0 and value != seen:
                at = _refine(reader, f"training_first_nonfinite_step{{{reader.selector},rank={prometheus.quote(rank)}}} == {value!r}", at)
                keys = _nonfinite_keys(reader, rank, at)
                hits.append((step_time(reader, rank, int(value), at), rank, int(value), keys + " non-finite"))
            seen = value
    return _group(hits, "nonfinite", 2 * reader.res)


def _nonfinite_keys(reader: Reader, rank: str, at: float) -> str:
    """The logged keys that went non-finite at `at` ("loss", "loss, grad_norm"), else "values"."""
    found = reader.client.query(f"increase(training_nonfinite_values_total{{{reader.selector},rank={prometheus.quote(rank)}}}"
                                f"[{int(2 * reader.res)}s]) > 0", at + reader.res)
    return ", ".join(sorted({s["metric"].get("key", "?") for s in found})) or "values"


def _refine(reader: Reader, expr: str, at: float) -> float:
    """The first time in (at - res, at] where `expr` has a value (1 s steps): the sample's own time."""
    step = max(1.0, reader.res / 200)
    found = reader.client.query_range(expr, at - reader.res + step, at, step)
    times = [float(t) for s in found for t, _ in s["values"]]
    return min(times) if times else at


def grad_spikes(reader: Reader) -> list[Event]:
    """Where TrainingGradientExplosion's condition holds (GRAD_SPIKE: the 2-min maximum of the
    gradient norm above 10x its median over the 30 min before): one event per spike and rank, at the
    first second it holds, its size GRAD_SPIKE_RATIO there (what the alert's description says)."""
    hits = []
    for rank, values in reader.by_rank(GRAD_SPIKE).items():
        sel = f"{reader.selector},rank={prometheus.quote(rank)}"
        last_hit = -math.inf
        for at, value in values:
            if at - last_hit > 300:
                at = _refine(reader, GRAD_SPIKE.replace("{SEL}", "{" + sel + "}"), at)
                ratio = _instant(reader, GRAD_SPIKE_RATIO.replace("{SEL}", "{" + sel + "}"), at)
                # The largest norm of the spike's window, and the step that logged it.
                norm = _instant(reader, f"max_over_time(training_grad_norm_max{{{sel}}}[2m])", at)
                step = _instant(reader, f"max_over_time((training_grad_norm_max_step{{{sel}}} and on (job, run, rank, "
                                        f"instance) training_grad_norm_max{{{sel}}} >= {norm!r})[2m:])", at) \
                    if norm is not None else None
                step = int(step) if step is not None else None
                size = f", {ratio:.3g}x its median over the 30 min before" if ratio is not None else ""
                hits.append((step_time(reader, rank, step, at) if step is not None else at, rank, step,
                             f"gradient norm {norm if norm is not None else value:.3g}{size}"))
            last_hit = at
    return _group(hits, "grad_spike", 2 * reader.res)


def _instant(reader: Reader, expr: str, at: float) -> float | None:
    """The (first) value of `expr` at `at`, or None."""
    found = reader.client.query(expr, at)
    return float(found[0]["value"][1]) if found else None


def step_time(reader: Reader, rank: str, step: int, seen: float) -> float:
    """When the rank logged `step`, by its own clock: between the pushes before and at `seen` (the first
    sample that showed it), the time of its last update interpolated on the steps. `seen` when unknown."""
    sel = f"{reader.selector},rank={prometheus.quote(rank)}"
    window = f"{int(2 * reader.res + 300)}s"
    pairs = {}
    for name in ("training_step", "training_last_update_timestamp_seconds"):
        for series in reader.client.query(f"{name}{{{sel}}}[{window}]", seen)[:1]:
            for at, value in series["values"]:
                pairs.setdefault(float(at), {})[name] = float(value)
    points = sorted((p["training_step"], p["training_last_update_timestamp_seconds"]) for p in pairs.values()
                    if len(p) == 2)
    after = next((i for i, (logged, _) in enumerate(points) if logged >= step), None)
    if after is None:
        return seen
    logged, update = points[after]
    if after == 0 or logged == step:
        return min(seen, update)
    before, then = points[after - 1]
    return min(seen, then + (update - then) * (step - before) / (logged - before))


def _sustained(values: list[tuple[float, float]], bad: Callable[[int], bool], start: int,
               duration: float) -> int | None:
    """Index of the first point at or after `start` from which `bad` holds for `duration` seconds."""
    i = start
    while i < len(values):
        if bad(i):
            j = i
            while j < len(values) and bad(j):
                if values[j][0] - values[i][0] >= duration:
                    return i
                j += 1
            i = j
        i += 1
    return None


def _episodes(values: list[tuple[float, float]], onset: Callable[[int], bool], held: Callable[[int], bool],
              duration: float) -> Iterator[tuple[int, int]]:
    """(first, end) indices of each episode: `onset` holds from `first` for `duration` seconds, and the
    episode lasts while `held` holds (`end`: the first point where it no longer does)."""
    i = 0
    while (first := _sustained(values, onset, i, duration)) is not None:
        end = first
        while end < len(values) and held(end):
            end += 1
        yield first, end
        i = end


def _rate_window(reader: Reader) -> float:
    """The window of step rates: the rules' 5 min, at least 4 points at coarse resolution."""
    return max(limits.RATE_WINDOW, 4 * reader.res)


def slowdowns(reader: Reader) -> list[Event]:
    """step_time_regression (the run's median step time up 20 % on the previous 30 min, for 10 min)
    and straggler (TrainingStragglerRank's condition: a rank below 75 % of the run's median step rate
    for 10 min); the numbers are dualtrack/thresholds.py's."""
    window = f"{int(_rate_window(reader))}s"
    rates = reader.by_rank(f"rate(training_steps_total{{SEL}}[{window}])")
    by_time: dict[float, dict[str, float]] = {}
    for rank, values in rates.items():
        for at, value in values:
            by_time.setdefault(at, {})[rank] = value
    # Ranks that stopped stepping (failed, finished) are not slow ranks: the median is of the others.
    times = sorted(t for t, ranks in by_time.items() if any(v > 0 for v in ranks.values()))
    median = [(t, statistics.median(v for v in by_time[t].values() if v > 0)) for t in times]
    events: list[Event] = []
    seconds = [(t, 1 / r if r > 0 else math.inf) for t, r in median]
    baseline: list[float] = []
    for i, (at, _) in enumerate(seconds):
        first = bisect.bisect_left(times, at - limits.REGRESSION_BASELINE)
        prior = [s for _, s in seconds[first:i] if math.isfinite(s)]
        baseline.append(statistics.median(prior) if len(prior) >= 5 else math.nan)
    i = 0
    while True:
        found = _sustained(seconds, lambda k: seconds[k][1] >= limits.REGRESSION_RATIO * baseline[k]
                           and math.isfinite(seconds[k][1]), i, limits.REGRESSION_FOR)
        if found is None:
            break
        at, before = seconds[found][0], baseline[found]
        k = found
        while k < len(seconds) and seconds[k][1] > limits.REGRESSION_RECOVERED * before:
            k += 1
        settled = statistics.median(s for _, s in seconds[found:k])
        events.append(Event("step_time_regression", reader.step_at(None, at), at, None, None,
                            f"step time rose from {before:.3g} s to {settled:.3g} s (x{settled / before:.2f})"))
        i = k
    if len(rates) >= 2:
        medians = dict(median)
        for rank, values in rates.items():
            share = [(t, v / medians[t] if medians.get(t) else 1.0) for t, v in values]
            for found, k in _episodes(share, lambda k: share[k][1] < limits.STRAGGLER_SHARE and values[k][1] > 0,
                                      lambda k: share[k][1] < limits.STRAGGLER_RECOVERED, limits.STRAGGLER_FOR):
                at = share[found][0]
                low = statistics.median(s for _, s in share[found:k])
                events.append(Event("straggler", reader.step_at(rank, at), at, rank, None,
                                    f"stepped at {low:.0%} of the run's median rate"))
    return events


def lockstep_stragglers(reader: Reader) -> list[Event]:
    """straggler under synchronous data parallelism (TrainingStragglerRank's collective-wait rule): a
    rank whose share of step time spent waiting in the collectives is STRAGGLER_WAIT_GAP or more below
    the run's largest, for STRAGGLER_WAIT_FOR seconds (dualtrack/thresholds.py). The ranks step at one
    pace there, so the step-rate straggler of slowdowns() cannot see it: the others wait for it."""
    window = f"{int(max(limits.STRAGGLER_WAIT_WINDOW, 4 * reader.res))}s"
    shares = reader.by_rank(f"rate(training_collective_wait_seconds_total{{SEL}}[{window}]) "
                            f"/ rate(training_step_duration_seconds_sum{{SEL}}[{window}])")
    by_time: dict[float, dict[str, float]] = {}
    for rank, values in shares.items():
        for at, value in values:
            if math.isfinite(value):
                by_time.setdefault(at, {})[rank] = value
    events: list[Event] = []
    for rank, values in shares.items():
        gap = [(at, max(by_time[at].values()) - value) for at, value in values
               if math.isfinite(value) and len(by_time[at]) >= 2]
        for found, k in _episodes(gap, lambda k: gap[k][1] >= limits.STRAGGLER_WAIT_GAP,
                                  lambda k: gap[k][1] >= limits.STRAGGLER_WAIT_GAP / 2, limits.STRAGGLER_WAIT_FOR):
            at = gap[found][0]
            lost = statistics.median(g for _, g in gap[found:k])
            events.append(Event("straggler", reader.step_at(rank, at), at, rank, None,
                                f"the other ranks waited for it in the collectives ({lost:.0%} of each step)"))
    return events


def starvation(reader: Reader) -> list[Event]:
    """A rank that waited for batches more than STARVATION_SHARE of the time (over 5 min) for
    STARVATION_FOR seconds (dualtrack/thresholds.py): TrainingDataLoaderBottleneck's condition."""
    window = f"{int(max(300, reader.res))}s"
    hits = []
    for rank, values in reader.by_rank(f"rate(training_data_wait_seconds_total{{SEL}}[{window}])").items():
        for found, _ in _episodes(values, lambda k: values[k][1] > limits.STARVATION_SHARE,
                                  lambda k: values[k][1] > limits.STARVATION_SHARE / 2, limits.STARVATION_FOR):
            at = values[found][0]
            hits.append((at, rank, reader.step_at(rank, at), "steps starved of data"))
    return _group(hits, "data_starvation", WINDOW)


def loss_scale_collapses(reader: Reader) -> list[Event]:
    """The loss scale below 1/1024 of its maximum so far."""
    hits = []
    for rank, values in reader.by_rank("training_loss_scale{SEL}").items():
        top, collapsed = -math.inf, False
        for at, value in values:
            if value < top / 1024 and not collapsed:
                hits.append((at, rank, reader.step_at(rank, at), f"loss scale fell from {top:g} to {value:g}"))
                collapsed = True
            elif value >= top / 1024:
                collapsed = False
            top = max(top, value)
    return _group(hits, "loss_scale_collapse", 2 * reader.res)


def ends(reader: Reader) -> list[Event]:
    """oom (the allocator counted an out-of-memory error) and failed (the run state became failed)."""
    hits: dict[str, list] = {"oom": [], "failed": []}
    for rank, values in reader.by_rank("training_cuda_ooms_total{SEL}").items():
        for (_, before), (at, value) in zip(values, values[1:]):
            if value > before:
                hits["oom"].append((at, rank, reader.step_at(rank, at), "CUDA out of memory"))
                break
    for rank, values in reader.by_rank('training_run_state{SEL,state="failed"}').items():
        at = next((t for t, v in values if v == 1), None)
        if at is not None:
            hits["failed"].append((at, rank, reader.step_at(rank, at), "failed"))
    return [e for kind, found in hits.items() for e in _group(found, kind, 300)]


def replica_divergences(reader: Reader) -> list[Event]:
    """replica_divergence: the first time a data-parallel rank's post-reduction grad norm was not its
    peers' (training_replica_divergent_steps_total grew; TrainingReplicaDivergence's condition)."""
    hits = []
    for rank, values in reader.by_rank("training_replica_divergent_steps_total{SEL}").items():
        at = next((t for t, v in values if v > 0), None)
        if at is not None:
            hits.append((at, rank, reader.step_at(rank, at),
                         "post-reduction gradient norm differs from its data-parallel peers' (a corrupted replica)"))
    return _group(hits, "replica_divergence", 300)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


#: The process name (comm, 15 bytes) of an MPS server or control daemon.
MPS_SERVER = "nvidia-cuda-mps.*"


def co_tenants(selector: str, rng: str, metric: str = PROCESS_MEMORY) -> str:
    """GPU processes of no run in `rng` (rules/explain.yml's co_tenant join), with the most of
    `metric` (a per-process series: memory, or SM utilization) each had: a process is a run's when
    its PID in its own namespace and its start time are a run's pid and start_time (the hook's
    training_process_info), or its PID namespace and its PID in it a run's pid_namespace and pid, or,
    for a run that reports neither, when its PID is the run's pid. A process the exporter could not
    read is never a co-tenant, nor an MPS server (it runs its clients' work)."""
    timed, in_namespace, bare = (f'last_over_time(training_process_info{{{matchers}}}[{rng}])' for matchers in
                                 ('start_time!=""', 'pid_namespace!=""', 'pid_namespace="",start_time=""'))
    return (f'max_over_time({metric}{{namespace_pid!="",process!~"{MPS_SERVER}",{selector}}}[{rng}]) '
            f'unless on (namespace_pid, start_time) label_join({timed}, "namespace_pid", "", "pid") '
            f'unless on (pid_namespace, namespace_pid) label_join({in_namespace}, "namespace_pid", "", "pid") '
            f'unless on (pid) {bare}')


def find_causes(reader: Reader, event: Event) -> list[Cause]:
    """The infra evidence on the event's GPU (all the run's GPUs for a run-wide event), ranked."""
    wanted = RELEVANT[event.kind]
    own = reader.exporter_gpus.get(event.rank) if event.rank is not None else None
    uuids = [own] if own else sorted(set(reader.exporter_gpus.values()))
    rank_of = {uuid: rank for rank, uuid in reader.exporter_gpus.items()}
    # MIG instances (parent uuid, gpu_instance) among them: each has its own memory and is isolated
    # from the other instances' processes, which NVML lists per GPU only (no co-tenant is named).
    ranks = [event.rank] if own else list(reader.exporter_gpus)
    slices = sorted({(reader.parents[r], reader.instances[r]) for r in ranks if r in reader.parents})
    whole = [u for u in uuids if u not in {parent for parent, _ in slices}]
    exporter = f"job={prometheus.quote(prometheus.EXPORTER_JOB)}"
    whole_sel = f"{exporter},uuid=~{prometheus.quote('|'.join(re.escape(u) for u in whole))}"
    causes: list[Cause] = []
    # A slowdown is seen through a rate window: what started in that window before it was seen counts.
    lag = max(120.0, 4 * reader.res) if event.kind in ("step_time_regression", "straggler", "data_starvation") else 0.0
    at, start = event.time + reader.res + lag, event.time - WINDOW
    rng = f"{int(WINDOW + reader.res)}s"

    def where(uuid: str) -> str:
        if uuid == own:
            return "on that GPU" if own == event.gpu_uuid else f"on its MIG instance's parent GPU ({uuid})"
        return f"on rank {rank_of.get(uuid, '?')}'s GPU ({uuid})"

    if uuids:
        sel = f"{exporter},uuid=~{prometheus.quote('|'.join(re.escape(u) for u in uuids))}"
        client = reader.client
        if wanted & {counter.kind for counter in COUNTERS.values()}:
            step = max(1.0, (at - start) / 600)
            counters = client.query_range(f'{{__name__=~"{"|".join(COUNTERS)}",{sel}}}', start, at, step)
            for series in counters:
                causes.extend(_counter_cause(series, event, where, wanted, start, step))
        if wanted & set(THROTTLE_KINDS):
            shares = client.query(f"increase(nvml_gpu_throttle_seconds_total{{{sel}}}[{rng}]) / {WINDOW + reader.res}", at)
            # The share of a kind is the sum of its reasons' on a GPU, as in the rules.
            throttled: dict[tuple[str, str], dict[str, float]] = {}
            for series in shares:
                reason, uuid = series["metric"].get("reason", ""), series["metric"].get("uuid", "")
                for kind in wanted & {k for k, reasons in THROTTLE_KINDS.items() if reason in reasons}:
                    throttled.setdefault((kind, uuid), {})[reason] = float(series["value"][1])
            for (kind, uuid), reasons in sorted(throttled.items()):
                share, named = sum(reasons.values()), " and ".join(r for r, v in sorted(reasons.items()) if v > 0)
                if share > limits.THROTTLE_SHARE:
                    causes.append(Cause(kind, f"{named} on {uuid} {share:.0%} of the {WINDOW / 60:.0f} min before",
                                        limits.score(kind),
                                        f"with {named.replace('_', ' ')} {where(uuid)} {share:.0%} of the time before"))
        if "clock_drop" in wanted:
            drops = client.query(f"min_over_time(nvml_gpu_clock_hertz{{clock=\"sm\",{sel}}}[{rng}]) / on (uuid, clock) "
                                 f"max_over_time(nvml_gpu_clock_hertz{{clock=\"sm\",{sel}}}[{rng}] offset {rng}) < {limits.CLOCK_DROP} "
                                 f"unless on (uuid) increase(nvml_gpu_throttle_seconds_total{{reason=\"gpu_idle\",{sel}}}[{rng}]) > 60", at)
            for series in drops:
                uuid, ratio = series["metric"].get("uuid", ""), float(series["value"][1])
                causes.append(Cause("clock_drop", f"SM clock of {uuid} fell to {ratio:.0%} of the 10 min before",
                                    limits.score("clock_drop"),
                                    f"with the SM clock {where(uuid)} at {ratio:.0%}"))
        if "link_drop" in wanted:
            links = client.query(f"sum by (uuid) (rate(nvml_gpu_nvlink_data_bytes_total{{{sel}}}[{rng}])) < {limits.LINK_DROP} * "
                                 f"sum by (uuid) (rate(nvml_gpu_nvlink_data_bytes_total{{{sel}}}[{rng}] offset {rng}))", at)
            for series in links:
                uuid = series["metric"].get("uuid", "")
                causes.append(Cause("link_drop", f"NVLink traffic of {uuid} halved in the 10 min before",
                                    limits.score("link_drop"),
                                    f"with NVLink traffic {where(uuid)} halved"))
        if "memory_pressure" in wanted:
            # A MIG instance's own memory (nvml_gpu_mig_memory_*) counts, not its parent's.
            fills = []
            if whole:
                fills.append(f"nvml_gpu_memory_used_bytes{{{whole_sel}}} / nvml_gpu_memory_total_bytes{{{whole_sel}}}")
            for parent, instance in slices:
                match = f"{exporter},uuid={prometheus.quote(parent)},gpu_instance={prometheus.quote(instance)}"
                fills.append(f"nvml_gpu_mig_memory_used_bytes{{{match}}} / nvml_gpu_mig_memory_total_bytes{{{match}}}")
            full = client.query(" or ".join(f"max_over_time(({fill})[{rng}:]) > {limits.MEMORY_FULL}" for fill in fills), at) if fills else []
            for series in full:
                uuid, ratio = series["metric"].get("uuid", ""), float(series["value"][1])
                instance = series["metric"].get("gpu_instance")
                memory = f"the memory of GPU instance {instance}" if instance else "the memory"
                causes.append(Cause("memory_pressure", f"{uuid}{f' GPU instance {instance}' if instance else ''} memory "
                                                       f"{ratio:.0%} full", limits.score("memory_pressure", event.kind == "oom"),
                                    f"with {ratio:.0%} of {memory} used {where(uuid)}"))
        if "co_tenant" in wanted and whole:
            causes.extend(_co_tenant_causes(client, whole_sel, rng, at, where))
    if "data_wait" in wanted:
        rank_sel = reader.selector + (f",rank={prometheus.quote(event.rank)}" if event.rank is not None else "")
        short = f"{int(max(120, 4 * reader.res))}s"
        waits = reader.client.query(f"max_over_time(rate(training_data_wait_seconds_total{{{rank_sel}}}[{short}])"
                                    f"[{rng}:{int(reader.res)}s]) > {limits.DATA_WAIT_SHARE}", at)
        for series in sorted(waits, key=lambda s: -float(s["value"][1]))[:1]:
            rank, share = series["metric"].get("rank", "?"), float(series["value"][1])
            causes.append(Cause("data_wait", f"rank {rank} waited for data up to {share:.0%} of the time in the "
                                             f"{WINDOW / 60:.0f} min before",
                                limits.data_wait_score(share), f"with rank {rank} waiting for data {share:.0%} of the time"))
    if "hyperparameter" in wanted and event.rank is not None:
        causes.extend(hyper_parameter_causes(reader, event))
    causes.sort(key=lambda c: -c.score)
    where = ", ".join(uuids) if uuids else "the run's GPUs: the run reports no GPU"
    return causes or [Cause("none_found", f"no infra evidence on {where} in the {WINDOW / 60:.0f} min before", 0.0, "")]


def hyper_parameter_causes(reader: Reader, event: Event) -> list[Cause]:
    """A logged hyper-parameter (HYPER_PARAMETERS) that changed HYPER_JUMP-fold or more from a sample at
    most HYPER_WINDOW before the event to the first sample that showed the event: its values before and after."""
    sel = f"{reader.selector},rank={prometheus.quote(event.rank)}"
    shown = event.time + reader.res  # the first sample at or after the event is in (time, time + res]
    window = f"{int(limits.HYPER_WINDOW + reader.res)}s"
    causes = []
    for name, candidates in HYPER_PARAMETERS.items():
        if name == "loss_scale" and event.kind == "loss_scale_collapse":
            continue  # the collapse is the loss scale's own fall
        found = []
        for series in candidates:
            found = found or reader.client.query(f"{series}{{{sel}}}[{window}]", shown)
        values = [(float(t), float(v)) for s in found[:1] for t, v in s["values"]]
        after = next((i for i, (at, _) in enumerate(values) if at >= event.time), len(values) - 1)
        for (then, before), (now, value) in reversed(list(zip(values[:after + 1], values[1:after + 1]))):
            if then < event.time - limits.HYPER_WINDOW:
                break
            if before > 0 and value > 0 and max(value / before, before / value) >= limits.HYPER_JUMP:
                moved = "jumped" if value > before else "fell"
                label = name.replace("_", " ")
                span = _ago(max(now, event.time) - then)
                causes.append(Cause("hyperparameter", f"{name} {moved} from {before:.4g} to {value:.4g} "
                                                      f"(x{value / before:.3g}) in the {span} up to the event",
                                    limits.score("hyperparameter"), f"after the {label} {moved} from {before:.4g} "
                                                                    f"to {value:.4g}"))
                break
    return causes


@dataclass(frozen=True)
class CounterCause:
    """An exporter counter whose rise before an event is a cause: its kind, whether a series is the
    kind's severe form (dualtrack/thresholds.py scores both), its evidence and its phrase (format
    fields: the series' labels, uuid, count, delta, at, where, meaning)."""

    kind: str
    severe: Callable[[dict[str, str]], bool]
    evidence: str
    phrase: str


def _xid(labels: dict[str, str]) -> int:
    code = labels.get("xid", "")
    return int(code) if code.isdigit() else 0


COUNTERS = {
    "nvml_exporter_gpu_lost_total": CounterCause(
        "gpu_lost", lambda labels: True, "{uuid} lost (stopped answering NVML) at {at}, {delta} before",
        "{delta} after a GPU loss {where} (it stopped answering NVML)"),
    "nvml_gpu_xid_errors_total": CounterCause(
        "xid", lambda labels: xids.is_disruptive(_xid(labels)), "XID {xid} ({meaning}) on {uuid} at {at}, {delta} before",
        "{delta} after XID {xid} ({meaning}) {where}"),
    "nvml_gpu_ecc_errors_total": CounterCause(
        "ecc", lambda labels: labels.get("error") == "uncorrected", "{count:.0f} {error} ECC error(s) on {uuid}, {delta} before",
        "{delta} after {error} ECC errors {where}"),
    "nvml_gpu_remapped_rows_total": CounterCause(
        "remapped_rows", lambda labels: labels.get("severity") == "uncorrectable",
        "{count:.0f} {severity} row(s) remapped on {uuid}, {delta} before", "{delta} after {severity} row remapping {where}"),
    "nvml_gpu_pcie_replay_errors_total": CounterCause(  # the lesser link_drop: NVLink traffic halved is the severe one
        "link_drop", lambda labels: False, "{count:.0f} PCIe replay(s) on {uuid}, {delta} before",
        "{delta} after PCIe replays {where}"),
}


class _Fields(dict):
    """Format fields: a label the series does not carry is empty."""

    def __missing__(self, key: str) -> str:
        return ""


def _co_tenant_causes(client: prometheus.Prometheus, selector: str, rng: str, at: float,
                      where: Callable[[str], str]) -> list[Cause]:
    """A cause per process of no run on the GPUs of `selector`: its memory and, where the exporter
    reads it, its peak SM utilization; one that computed ranks above one that only holds memory."""
    def by_process(metric: str) -> dict[tuple[str, str, str], float]:
        found = client.query(f"max by (uuid, pid, process) ({co_tenants(selector, rng, metric)})", at)
        return {(s["metric"].get("uuid", ""), s["metric"].get("pid", ""), s["metric"].get("process", "")):
                float(s["value"][1]) for s in found}

    computing = by_process(PROCESS_SM)
    causes = []
    for (uuid, pid, process), used in sorted(by_process(PROCESS_MEMORY).items()):
        name, sm = process or "?", computing.get((uuid, pid, process))
        computes = sm is not None and sm > limits.CO_TENANT_SM
        causes.append(Cause("co_tenant", f"process {name} (pid {pid}) of no run on {uuid}, {used / 2**30:.1f} GiB"
                                         + ("" if sm is None else f", {sm:.0%} SM"),
                            limits.score("co_tenant", computes),
                            f"with another process ({name}, pid {pid}"
                            + (f", computing {sm:.0%} of the SMs" if computes else "") + f") {where(uuid)}"))
    return causes


def _counter_cause(series: dict[str, Any], event: Event, where: Callable[[str], str], wanted: set[str], window_start: float,
                   step: float) -> list[Cause]:
    """A counter of COUNTERS (XID, ECC, remapped rows, PCIe replays, GPU lost) that rose in the window: one cause."""
    labels = series["metric"]
    counter = COUNTERS.get(labels.get("__name__", ""))
    values = _values(series)
    if counter is None or counter.kind not in wanted or not values:
        return []
    # A series that appears inside the window rose from 0 (an XID series appears with its first XID).
    before = values[0][1] if values[0][0] <= window_start + step / 2 else 0.0
    rose_at = next((at for at, value in values if value > before), None)
    if rose_at is None:
        return []
    uuid = labels.get("uuid", "")
    fields = _Fields(labels, uuid=uuid, count=values[-1][1] - before, delta=_ago(event.time - rose_at), at=utc(rose_at),
                     where=where(uuid), meaning=xids.meaning(_xid(labels)))
    return [Cause(counter.kind, counter.evidence.format_map(fields), limits.score(counter.kind, counter.severe(labels)),
                  counter.phrase.format_map(fields))]


def sentence(event: Event, ranks: int, gpus: bool = True) -> str:
    """One plain sentence: what, where, the top cause, the other ranks, the verdict (`gpus`: whether the
    run reports any GPU; a run that reports none is not said to have GPU evidence or not)."""
    who = f" on rank {event.rank}" + (f" ({event.gpu_uuid})" if event.gpu_uuid else "") if event.rank is not None else ""
    text = f"step {event.step if event.step is not None else '?'}: {event.detail}{who}"
    top = event.causes[0] if event.causes else None
    if top is not None and top.kind != "none_found":
        text += f" {top.phrase}"
    if event.kind in ("nonfinite", "grad_spike", "loss_scale_collapse", "data_starvation") and ranks > 1:
        if not event.others:
            text += "; no other rank affected"
        elif len(event.others) + 1 >= ranks:
            text += f"; all {ranks} ranks affected"
        else:
            text += f"; also rank(s) {', '.join(sorted(event.others, key=_rank_key))}"
    if top is None or top.kind == "none_found":
        if event.kind in ("nonfinite", "grad_spike", "loss_scale_collapse"):
            text += ": no GPU evidence, so the model or its input" if gpus else \
                ": the run reports no GPU and no hyper-parameter changed, so the model or its input"
        else:
            text += ": no GPU or input evidence found" if gpus else ": the run reports no GPU; no input evidence found"
    elif top.kind in HARDWARE:
        text += ": hardware, not the model"
    else:
        text += f": {VERDICT[top.kind]}"
    return text


def render_text(found: Timeline) -> str:
    """The timeline as plain text: a header line, then each event and its ranked causes."""
    gpus = ", ".join(f"rank {r} {u}" + (f" (on {found.parent_gpus[r]})" if r in found.parent_gpus else "")
                     for r, u in sorted(found.gpus.items(), key=lambda x: _rank_key(x[0])))
    launch = f" launch {found.launch}" if found.launch else ""
    lines = [f"run {found.run} (job {found.job}){launch}: {utc(found.start)} to {utc(found.end)}; "
             f"GPUs: {gpus or 'none (the run reports no GPU)'}"]
    if found.other_launches:
        others = ", ".join(f"{o['launch']} (started {utc(o['start'])})" for o in found.other_launches)
        lines.append(f"other launches: {others}; pick one with --launch ID")
    if not found.events:
        lines.append("no model-track event (non-finite values, spikes, slowdowns, stragglers, data starvation, "
                     "loss-scale collapse, OOM, failure): nothing to explain")
    for event in found.events:
        lines.append(f"{utc(event.time)}  {event.kind}: {event.sentence}")
        for cause in event.causes:
            lines.append(f"    {cause.score:.2f} {cause.kind}: {cause.evidence}")
    # Label values (process names, runs, uuids) are anyone's text: no terminal escape reaches the screen.
    return "\n".join(one_line(line) for line in lines)
