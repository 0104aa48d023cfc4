"""Busy seconds are exact between scrapes: utilization alternating 100 % / 0 % every 2 s, scraped
every 30 s, gives rate(nvml_gpu_busy_seconds_total[2m]) = 0.50 +- 0.05 (fake clock, 10 simulated minutes)."""
from __future__ import annotations

import pytest

from tests.exporter_support import Rig


def prometheus_rate(points: list[tuple[float, float]], at: float, window: float = 120.0) -> float:
    """rate(x[window]) at time `at` from (time, value) scrapes, as Prometheus computes it without
    extrapolation: the increase between the first and last scrape inside the window, per second."""
    inside = [(t, v) for t, v in points if at - window < t <= at]
    (t0, v0), (t1, v1) = inside[0], inside[-1]
    return (v1 - v0) / (t1 - t0)


@pytest.mark.parametrize("scrape_offset", [0.0, 0.7, 1.3, 2.9])
@pytest.mark.parametrize("sample_interval", [1.0, 3.0])
def test_busy_rate_at_30s_scrapes_reads_half(scrape_offset, sample_interval):
    rig = Rig("input-bound", gpus=1, collectors=["utilization"], interval=sample_interval)
    uuid = rig.sampler.devices[0].uuid
    rig.step(scrape_offset or sample_interval)
    elapsed, next_scrape, scrapes, gauges = 0.0, 30.0, [], []
    while elapsed < 600:
        rig.step()
        elapsed += sample_interval
        if elapsed >= next_scrape:
            scrapes.append((elapsed, rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid)))
            gauges.append(rig.value("nvml_gpu_utilization_ratio", gpu="0", uuid=uuid))
            next_scrape += 30.0
    rates = [prometheus_rate(scrapes, at) for at, _ in scrapes[4:]]
    assert all(0.45 <= rate <= 0.55 for rate in rates), rates
    # The instantaneous gauge only ever shows 0 or 1 at these scrapes: it cannot tell this story.
    assert set(gauges) <= {0.0, 1.0}


def test_idle_seconds_follow_the_idle_threshold():
    rig = Rig("input-bound", gpus=1, collectors=["utilization"])
    uuid = rig.sampler.devices[0].uuid
    rig.step()
    start = rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid)
    for _ in range(40):
        rig.step()
    assert rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid) - start == pytest.approx(20, abs=0.5)
