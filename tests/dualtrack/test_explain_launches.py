"""`dualtrack explain` on a run id launched twice (real CPU hooks -> a real Pushgateway -> a real Prometheus
with the shipped rules): the latest launch by default, the other listed, --launch for it; its events are its
own. The run reports no GPU, and explain says so instead of talking about its GPU."""
from __future__ import annotations

import json

import pytest

from dualtrack.cli import main
from stack import processes
from tests.support import daemons
from tests.support.hook import Trainer, live_stack, run_id
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.e2e


def test_explain_takes_the_latest_launch_lists_the_other_and_says_the_run_has_no_gpu(
        tmp_path, start_service, capsys, monkeypatch):
    monkeypatch.setenv("DUALTRACK_DELETE_AFTER", "none")  # the next launch replaces the group
    pgw = start_service(processes.pushgateway(tmp_path))
    config = processes.render_prometheus_config(tmp_path, {processes.PUSHGATEWAY_JOB: [pgw.address]},
                                                scrape_interval="1s", evaluation_interval="1s")
    prometheus = start_service(processes.prometheus(tmp_path, config))
    run = run_id("relaunch")
    ids = []
    nan_step = -1
    for launch in range(2):
        monitor = TrainingMonitor(job="explain-launches", run=run, pushgateway=pgw.url, push_interval=0.2,
                                  record_path=False)
        ids.append(monitor._process.launch)
        trainer = Trainer()
        with monitor:
            for _ in range(5):
                trainer.train_step(monitor)
            if launch == 0:  # the first launch goes non-finite once, then recovers
                nan_step = trainer.step
                trainer.train_step(monitor, loss_scale=float("nan"))
                wanted = f'training_first_nonfinite_step{{run="{run}"}} == {nan_step}'
            else:
                wanted = (f'training_step{{run="{run}"}} >= 0 and on (job, run, rank, instance) '
                          f'training_launch_info{{launch="{ids[1]}"}}')
            def stepped(trainer: Trainer = trainer, monitor: TrainingMonitor = monitor, wanted: str = wanted) -> list:
                trainer.train_step(monitor)  # one step a poll, until Prometheus holds what this launch pushed
                return daemons.query(prometheus.url, wanted)

            processes.wait_until(stepped, 30, interval=0.2, what=wanted)
    assert ids[0] != ids[1]

    assert main(["explain", run, "--prometheus", prometheus.url, "--since", "10m", "--json"]) == 0
    latest = json.loads(capsys.readouterr().out)
    assert latest["launch"] == ids[1] and [o["launch"] for o in latest["other_launches"]] == [ids[0]]
    assert [e["kind"] for e in latest["events"]] == []  # the NaN was the other launch's

    assert main(["explain", run, "--prometheus", prometheus.url, "--since", "10m", "--launch", ids[0], "--json"]) == 0
    earlier = json.loads(capsys.readouterr().out)
    assert earlier["launch"] == ids[0] and [o["launch"] for o in earlier["other_launches"]] == [ids[1]]
    events = earlier["events"]
    assert [(e["kind"], e["step"]) for e in events] == [("nonfinite", nan_step)], events
    assert events[0]["gpu_uuid"] is None and "GPU" not in events[0]["sentence"].replace("reports no GPU", "")
    assert events[0]["sentence"].endswith("the run reports no GPU and no hyper-parameter changed, so the model or "
                                          "its input")
    assert events[0]["causes"][0]["evidence"].startswith("no infra evidence on the run's GPUs: the run reports no GPU")

    assert main(["explain", run, "--prometheus", prometheus.url, "--since", "10m", "--launch", ids[0]]) == 0
    text = capsys.readouterr().out
    assert f"launch {ids[0]}:" in text and "GPUs: none (the run reports no GPU)" in text
    assert f"other launches: {ids[1]} (started " in text and "--launch ID" in text
    assert main(["explain", run, "--prometheus", prometheus.url, "--since", "10m", "--launch", "nope"]) == 1
    assert "no launch 'nope'" in capsys.readouterr().err


def test_a_cpu_runs_report_has_no_gpu_panels_and_says_the_run_reports_no_gpu(tmp_path, start_service):
    """A real CPU run next to a (simulated) exporter's GPUs: none of them is the run's."""
    pgw, _, prometheus = live_stack(tmp_path, start_service, "--simulate=healthy", "--simulate.gpus=2")
    run = run_id("cpu")
    records = tmp_path / "records"
    records.mkdir()
    with TrainingMonitor(job="cpu-run", run=run, pushgateway=pgw.url, push_interval=0.2,
                         record_path=records) as monitor:
        trainer = Trainer()
        processes.wait_until(lambda: [trainer.train_step(monitor)] and daemons.query(
            prometheus.url, f'training_step{{run="{run}"}} >= 3') and len(daemons.query(
                prometheus.url, "nvml_gpu_utilization_ratio[10s]")[0]["values"]) >= 3, 30, interval=0.2,
            what="the run's steps and three scrapes of the GPUs")
    out = tmp_path / "cpu.html"
    assert main(["report", run, "--records", str(records), "--out", str(out), "--prometheus", prometheus.url]) == 0
    page = out.read_text()
    assert f"run {run}: the run reports no GPU" in page
    assert ">GPU utilization<" not in page and "all GPUs" not in page

