"""MFU live: a real hook pushing model FLOPs to a real Pushgateway, the simulated exporter's GPU (named
as NVML names an H100 SXM), a real Prometheus evaluating the shipped rules: job_run:training_mfu:ratio
is the run's model FLOP/s over the H100's dense bf16 peak."""
from __future__ import annotations

import math
import time

import pytest

from dualtrack.gpu_peaks import peak
from stack import processes
from tests.support import daemons
from tests.support.hook import live_stack, run_id
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.e2e


def test_a_live_run_on_a_known_gpu_has_its_mfu(tmp_path, start_service):
    pgw, _, prometheus = live_stack(tmp_path, start_service, "--simulate=healthy", "--simulate.gpus=1")
    [gpu] = daemons.wait_for_series(prometheus.url, "nvml_gpu_info", 30)
    bf16 = peak(gpu["metric"]["name"], "bf16")
    assert bf16, gpu["metric"]["name"]
    run = run_id("mfu-live")
    mfu = f'job_run:training_mfu:ratio{{run="{run}"}}'
    with TrainingMonitor(job="mfu-live", run=run, pushgateway=pgw.url, push_interval=0.2,
                         gpu_uuid=gpu["metric"]["uuid"], record_path=False, flops_per_token=1e11,
                         precision="bf16") as monitor:
        step = 0

        def train() -> list[dict]:
            nonlocal step
            step += 1
            monitor.log({"loss": 1.0 / step}, step=step, tokens=1000)
            time.sleep(0.05)  # pace the loop: a step every ~50 ms
            return daemons.query(prometheus.url, mfu)

        [sample] = processes.wait_until(train, 60, interval=0.0, what="the run's MFU in Prometheus")
        at, value = float(sample["value"][0]), float(sample["value"][1])
        [flops] = daemons.query(prometheus.url, f'sum(rate(training_model_flops_total{{run="{run}"}}[5m]))', at=at)
    assert sample["metric"] == {"__name__": "job_run:training_mfu:ratio", "job": "mfu-live", "run": run}
    assert value > 0 and math.isclose(value, float(flops["value"][1]) / bf16, rel_tol=0.2)
