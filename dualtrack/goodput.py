"""A run's goodput, energy efficiency, ETA and paused time over its life, from the rules in rules/goodput.yml
and the hook's training_paused_seconds_total."""
from __future__ import annotations

import re
from typing import Any

from . import prometheus

#: figure -> PromQL over the run's life (SEL: its label matchers, RANGE: its length).
QUERIES = {
    "goodput": "avg_over_time(job_run:training_goodput:ratio_rate5m{SEL}[RANGE])",
    "tokens_per_joule": "avg_over_time(job_run:training_tokens_per_joule:rate5m{SEL}[RANGE])",
    "samples_per_joule": "avg_over_time(job_run:training_samples_per_joule:rate5m{SEL}[RANGE])",
    "eta_seconds": "last_over_time(job_run:training_eta_seconds:rate5m{SEL}[RANGE])",
    # seconds paused (monitor.paused()) per reason, its ranks' mean: one figure "paused_seconds:<reason>" each
    "paused_seconds": "avg by (reason) (max_over_time(training_paused_seconds_total{SEL}[RANGE]))",
}
#: What the run lost, by reason, as a share of its life's goodput evaluations (a reason that held for
#: part of the run counts for that part): rules/goodput.yml's job_run_reason:training_lost:ratio_rate5m.
LOST = ("sum by (reason) (sum_over_time(job_run_reason:training_lost:ratio_rate5m{SEL}[RANGE])) / scalar("
        "sum(count_over_time(job_run:training_goodput:ratio_rate5m{SEL}[RANGE])))")


def run_goodput(client: prometheus.Prometheus, job: str, run: str, start: float, end: float) -> dict[str, float]:
    """The figures Prometheus recorded for the run between `start` and `end` (absent ones left out); a
    query answering per `reason` gives one figure per reason, named "<figure>:<reason>"; and
    "lost_<reason>" for each reason the run lost GPU-seconds to (non-finite, skipped steps...)."""
    values = {"SEL": f"job={prometheus.quote(job)},run={prometheus.quote(run)}",
              "RANGE": f"{max(60, int(end - start) + 60)}s"}
    found: dict[str, float] = {}
    for name, expr in QUERIES.items():
        # One pass: a value inserted (a run named "RANGE") is never replaced again.
        query = re.sub("SEL|RANGE", lambda placeholder: values[placeholder[0]], expr)
        result: list[dict[str, Any]] = client.query(query, end)
        for series in result:
            reason = series["metric"].get("reason")
            found.setdefault(name if reason is None else f"{name}:{reason}", float(series["value"][1]))
    if "goodput" in found:
        lost = client.query(re.sub("SEL|RANGE", lambda placeholder: values[placeholder[0]], LOST), end)
        for series in lost:
            share = float(series["value"][1])
            if share > 0 and series["metric"].get("reason"):
                found["lost_" + series["metric"]["reason"]] = share
    return found
