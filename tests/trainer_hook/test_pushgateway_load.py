"""Load test (slow, out of the default run): one real Pushgateway under many ranks pushing the hook's payload."""
from __future__ import annotations

import sys

import pytest

from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "bench"))
import bench_pushgateway

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_100_ranks_pushing_every_5_s_are_all_accepted_and_scraped(tmp_path):
    """The shipped gateway (consistency check on) lands every push on time for 100 ranks pushing every
    5 s, measured on a loaded machine (docs/scaling.md)."""
    payload = bench_pushgateway.hook_payload()
    samples_per_rank = sum(1 for line in payload.decode().splitlines() if line and not line.startswith("#"))
    figures = bench_pushgateway.run_load(100, seconds=15, workers=2, payload=payload, workdir=tmp_path)
    assert figures["errors"] == 0
    assert figures["achieved_per_s"] >= 0.95 * figures["wanted_per_s"]
    assert figures["latency_p99_ms"] < 5000
    # every rank's group is there, each with its samples plus the gateway's push_time/push_failure_time
    assert figures["prom_scrape_samples"] >= 100 * (samples_per_rank + 2)
    assert figures["metrics_bytes"] > 100 * len(payload) * 0.8
