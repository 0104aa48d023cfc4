"""The queries of one explanation: a run's extent, resolution, ranks and GPUs, and its series by rank."""
from __future__ import annotations

import math
from typing import Any

from .. import prometheus
from .. import thresholds as limits
from ..summary import utc
from .model import ExplainError, rank_key
from .promql import Label, fill, matchers, not_equal, seconds, selector


def points(series: dict[str, Any]) -> list[tuple[float, float]]:
    """A range answer's series as (time, value) pairs."""
    return [(float(t), float(v)) for t, v in series["values"]]


class Reader:
    """A run between `since` and `until`: where it starts and ends, the resolution of its range
    queries, its job, ranks and GPUs (a MIG rank's parent GPU, as the exporter's series name it).
    Raises ExplainError when the run has no training_step series there."""

    def __init__(self, client: prometheus.Prometheus, run: str, since: float, until: float) -> None:
        self.client = client
        self.run = matchers(run=run)
        rng = seconds(max(limits.MIN_SPAN, until - since))
        starts = client.query(f"min(min_over_time({self.select('training_start_timestamp_seconds')}[{rng}]))", until)
        # 0 until a step is logged: no end yet
        ends = client.query(f"max(max_over_time({self.select('training_last_update_timestamp_seconds')}[{rng}]) > 0)",
                            until)
        jobs = client.query(f"count by (job, rank) (last_over_time({self.select('training_step')}[{rng}]))", until)
        if not jobs:
            raise ExplainError(f"run {run!r}: no training_step series between {utc(since)} and {utc(until)} "
                               "(check the run id, --since and --until)")
        self.job = jobs[0]["metric"].get("job", "")
        self.ranks = sorted({s["metric"].get("rank", "") for s in jobs}, key=rank_key)
        first, last = (float(found[0]["value"][1]) if found else math.nan for found in (starts, ends))
        self.start = max(since, first) if math.isfinite(first) else since
        self.end = min(until, last + limits.END_MARGIN) if math.isfinite(last) else until
        self.res = max(limits.MIN_RESOLUTION, math.ceil((self.end - self.start) / limits.MAX_POINTS))
        # Range queries step from start: the last point must be the end (what happened last counts).
        self.start = self.end - math.ceil((self.end - self.start) / self.res) * self.res
        info = client.query(f"max by (rank, uuid) (last_over_time({self.select('training_gpu_info')}[{rng}]))", until)
        self.gpus = {s["metric"].get("rank", ""): s["metric"]["uuid"] for s in info if "uuid" in s["metric"]}
        # The uuid of each rank's GPU in the exporter's series: a MIG instance's parent GPU.
        mig = self.select("job_run_rank_gpu:training_gpu_info:nvml", mig_uuid=not_equal(""))
        joined = client.query(f"max by (rank, uuid, gpu_instance) (last_over_time({mig}[{rng}]))", until)
        self.parents = {s["metric"].get("rank", ""): s["metric"]["uuid"] for s in joined if "uuid" in s["metric"]}
        self.instances = {s["metric"].get("rank", ""): s["metric"].get("gpu_instance", "") for s in joined}
        self.exporter_gpus = {rank: self.parents.get(rank, uuid) for rank, uuid in self.gpus.items()}

    def select(self, name: str, **labels: Label) -> str:
        """A selector of the run's series `name` (and `labels`: a rank of None matches every rank)."""
        return selector(name, self.run, **labels)

    def fill(self, template: str, **labels: Label) -> str:
        """`template` (a rule's expression, `{SEL}` where its matchers go) for the run (and `labels`)."""
        return fill(template, self.run, **labels)

    def by_rank(self, expr: str) -> dict[str, list[tuple[float, float]]]:
        """`expr` over the run, one value list per rank."""
        found = self.client.query_range(expr, self.start, self.end, self.res)
        out: dict[str, list[tuple[float, float]]] = {}
        for series in found:
            out.setdefault(series["metric"].get("rank", ""), []).extend(points(series))
        return out

    def instant(self, expr: str, at: float) -> float | None:
        """The (first) value of `expr` at `at`, or None."""
        found = self.client.query(expr, at)
        return float(found[0]["value"][1]) if found else None

    def recent(self) -> str:
        """The range that holds a rank's last samples at a time: NEAR_POINTS points and the lookback."""
        return seconds(limits.NEAR_POINTS * self.res + limits.LOOKBACK)

    def step_at(self, rank: str | None, at: float) -> int | None:
        """The run's (the rank's) training_step at `at`."""
        found = self.instant(f"max(last_over_time({self.select('training_step', rank=rank)}[{self.recent()}]))", at)
        return int(found) if found is not None else None

    def refine(self, expr: str, at: float) -> float:
        """The first time in (at - res, at] where `expr` has a value (1 s steps at least): the sample's own time."""
        step = max(1.0, self.res / limits.REFINE_STEPS)
        found = self.client.query_range(expr, at - self.res + step, at, step)
        times = [float(t) for s in found for t, _ in s["values"]]
        return min(times) if times else at
