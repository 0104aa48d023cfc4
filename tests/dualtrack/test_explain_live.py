"""`dualtrack explain` on a live run: the simulated exporter's "xid" scenario (XID 79, 30 s in) on
rank 1's GPU, two real hooks pushing to a real Pushgateway, a real Prometheus scraping both; rank 1's
loss goes NaN after the XID and explain blames the GPU."""
from __future__ import annotations

import json
import math

import pytest

from dualtrack.cli import main
from stack import demo_training, processes
from tests.support import daemons
from tests.support.hook import live_stack, run_id
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.e2e


def test_a_live_nan_after_a_simulated_xid_79_blames_that_gpu(tmp_path, start_service, capsys):
    pgw, _, prometheus = live_stack(tmp_path, start_service, "--simulate=healthy,xid", "--simulate.gpus=2")
    uuids = {s["metric"]["gpu"]: s["metric"]["uuid"]
             for s in daemons.wait_for_series(prometheus.url, "nvml_gpu_info", 30)}
    run = run_id("live-xid")
    monitors = [TrainingMonitor(job="explain-live", run=run, pushgateway=pgw.url, push_interval=0.2, rank=rank,
                                world_size=2, gpu_uuid=uuids[str(rank)], record_path=False)
                for rank in range(2)]
    step = 0

    def train(nan_on: int | None = None) -> None:
        nonlocal step
        step += 1
        for rank, monitor in enumerate(monitors):
            monitor.log({"loss": math.nan if rank == nan_on else 1.0 / step}, step=step)

    xid = f'nvml_gpu_xid_errors_total{{uuid="{uuids["1"]}",xid="79"}}'
    processes.wait_until(lambda: train() or daemons.query(prometheus.url, xid), 60, interval=0.2,
                         what="the simulated XID 79 in Prometheus")
    first_nan = step + 1
    processes.wait_until(lambda: train(nan_on=1) or daemons.query(
        prometheus.url, f'training_first_nonfinite_step{{run="{run}",rank="1"}} >= 0'), 30, interval=0.2,
        what="rank 1's non-finite step in Prometheus")
    for monitor in monitors:
        monitor.close()
    assert main(["explain", run, "--prometheus", prometheus.url, "--since", "10m", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    nonfinite = [e for e in found["events"] if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1, found
    event = nonfinite[0]
    assert (event["rank"], event["step"], event["gpu_uuid"]) == ("1", first_nan, uuids["1"])
    assert [c["kind"] for c in event["causes"]] == ["xid"]
    assert "XID 79 (GPU has fallen off the bus)" in event["sentence"] and "no other rank affected" in event["sentence"]


def test_the_demos_learning_rate_jump_is_named_as_the_cause_of_its_nan(tmp_path, start_service, capsys, monkeypatch):
    """The demo's exploding run, for real: its learning rate jumps x1e4 at step 400 (4 s in: a few scrapes
    before), the loss goes non-finite, and the run rolls back (its learning rate too) within the same push.
    explain names the jump, with its values, as the cause of the non-finite step."""
    pgw, _, prometheus = live_stack(tmp_path, start_service, "--simulate=healthy")
    monkeypatch.setenv("DUALTRACK_DELETE_AFTER", "none")
    # Prometheus scrapes the Pushgateway before the run starts: it sees the steps before the jump.
    daemons.wait_for_series(prometheus.url, f'up{{job="{processes.PUSHGATEWAY_JOB}"}} == 1', 30)
    run = run_id("explode")
    demo_training.train(demo_training.parse_args([
        "--pushgateway", pgw.url, "--run", run, "--learning-rate", "3e-2", "--explode-at", "400", "--steps", "500",
        "--step-time", "0.01", "--push-interval", "0.25"]))
    daemons.wait_for_series(prometheus.url, f'training_run_state{{run="{run}",state="finished"}} == 1', 30)
    assert main(["explain", run, "--prometheus", prometheus.url, "--since", "10m", "--json"]) == 0
    events = [e for e in json.loads(capsys.readouterr().out)["events"] if e["kind"] == "nonfinite"]
    assert events and events[0]["step"] >= 400, events
    cause = events[0]["causes"][0]
    assert cause["kind"] == "hyperparameter" and cause["evidence"].startswith("learning_rate jumped from 0.03 to 300 ")
    assert "after the learning rate jumped from 0.03 to 300" in events[0]["sentence"]
    assert events[0]["sentence"].endswith("a hyper-parameter change, not the GPU")
