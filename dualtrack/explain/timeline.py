"""A run's timeline: the launch explained, its events (events.py), each with its causes (causes.py)
and its sentence (render.py)."""
from __future__ import annotations

import math
import time

from .. import prometheus
from .. import thresholds as limits
from ..summary import utc
from .causes import find_causes
from .events import find_events
from .model import ExplainError, Timeline
from .promql import matchers, seconds, selector
from .reader import Reader, points
from .render import sentence


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
    events = find_events(reader)
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
    from ..records import LAUNCH_TIME_FORMAT
    sel = matchers(run=run)
    step = max(1.0, math.ceil((until - since) / limits.MAX_POINTS))
    rng = seconds(step)
    started = f"max_over_time({selector('training_start_timestamp_seconds', sel)}[{rng}])"
    named = f"last_over_time({selector('training_launch_info', sel)}[{rng}])"
    answer = client.query_range(f"min({started})", since, until, step)
    starts = dict(points(answer[0])) if answer else {}
    found: dict[str, tuple[float, float]] = {}
    for series in client.query_range(f"max by (launch) ({named})", since, until, step):
        first = series["values"][0][0]
        found[series["metric"].get("launch", "")] = (starts.get(first, first), first)
    unnamed = client.query_range(f"min({started} unless on (job, run, rank, instance) {named})", since, until, step)
    for at, value in points(unnamed[0]) if unnamed else []:
        found.setdefault(time.strftime(LAUNCH_TIME_FORMAT, time.gmtime(value)), (value, at))
    return found
