"""Remote write on two real engines: Debian's Prometheus with --web.enable-remote-write-receiver (the
project's rules evaluate the remote-written series, and hold the same series and labels as a run
pushed through the Pushgateway and scraped with honor_labels), and Debian's VictoriaMetrics (the run's
series are queryable through its Prometheus API, and vmalert fires the same alert from the same rules)."""
from __future__ import annotations

import pytest
import requests

from stack import processes
from tests import daemons
from tests.alerting_support import PROMETHEUS_TEST_ARGS
from tests.hook_support import Trainer, run_id
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.e2e

#: Series only the Pushgateway adds to what it serves.
PUSHGATEWAY_ONLY = {"push_time_seconds", "push_failure_time_seconds"}


def series(prometheus_url: str, run: str) -> set[tuple[tuple[str, str], ...]]:
    """Every series the hook gave `run` (not the recording rules'), without the run label (so two runs
    compare)."""
    answer = requests.get(f"{prometheus_url}/api/v1/series", timeout=10,
                          params={"match[]": f'{{run="{run}",__name__=~"training_.*"}}'})
    answer.raise_for_status()
    return {tuple(sorted((k, v) for k, v in labels.items() if k != "run")) for labels in answer.json()["data"]
            if labels["__name__"] not in PUSHGATEWAY_ONLY}


def test_remote_written_run_fires_the_rules_with_the_pushgateways_series(tmp_path, start_service):
    pushgateway = start_service(processes.pushgateway(tmp_path))
    config = processes.render_prometheus_config(tmp_path, {processes.PUSHGATEWAY_JOB: [pushgateway.address]},
                                                scrape_interval="1s", evaluation_interval="1s")
    prometheus = start_service(processes.prometheus(
        tmp_path, config, extra_args=[*PROMETHEUS_TEST_ARGS, daemons.REMOTE_WRITE_RECEIVER]))
    runs = {"pushed": run_id("pgw"), "written": run_id("rw")}
    monitors = {
        "pushed": TrainingMonitor(job="rw-test", run=runs["pushed"], pushgateway=pushgateway.url,
                                  push_interval=0.5, record_path=tmp_path / "pushed.jsonl", config={"lr": 0.01}),
        "written": TrainingMonitor(job="rw-test", run=runs["written"], push_interval=0.5,
                                   remote_write_url=prometheus.url + daemons.REMOTE_WRITE_PATH,
                                   record_path=tmp_path / "written.jsonl", config={"lr": 0.01}),
    }
    trainers = {path: Trainer() for path in monitors}
    for path, monitor in monitors.items():
        for _ in range(10):
            trainers[path].train_step(monitor)
        trainers[path].train_step(monitor, loss_scale=float("nan"), batch_id=4242)
        trainers[path].train_step(monitor)
    for run in runs.values():
        daemons.wait_for_series(prometheus.url, f'training_nonfinite_steps_total{{run="{run}"}} >= 1', 60)

    def firing() -> list[dict]:
        alerts = requests.get(prometheus.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "TrainingLossNonFinite"
                and a["labels"]["run"] == runs["written"] and a["state"] == "firing"]

    alert, = processes.wait_until(firing, 60, what="TrainingLossNonFinite from remote-written series")
    assert {k: alert["labels"][k] for k in ("job", "rank", "severity")} == {"job": "rw-test", "rank": "0",
                                                                            "severity": "critical"}
    assert "since step 10, batch 4242" in alert["annotations"]["description"]
    # the same series, with the same labels, on both paths (the hook's own push time included)
    written = series(prometheus.url, runs["written"])
    assert len(written) > 60 and written == series(prometheus.url, runs["pushed"])
    assert daemons.query(prometheus.url, f'push_time_seconds{{run="{runs["written"]}"}}') == []
    for monitor in monitors.values():
        monitor.close()
    assert monitors["written"]._writer.failures == 0
    daemons.wait_for_series(prometheus.url, f'training_run_state{{run="{runs["written"]}",state="finished"}} == 1', 30)


def test_victoria_metrics_serves_the_runs_series_and_vmalert_fires_the_rules(tmp_path, start_service,
                                                                           monkeypatch):
    """A run with only DUALTRACK_REMOTE_WRITE_URL set (no Pushgateway anywhere)."""
    vm = start_service(daemons.victoria_metrics(tmp_path))
    alertmanager = start_service(processes.alertmanager(tmp_path, processes.render_alertmanager_config(
        tmp_path, {"DUALTRACK_WEBHOOK_URL": "http://127.0.0.1:9/unused"})))
    rules = start_service(daemons.vmalert(tmp_path, vm.url, alertmanager.url))
    run = run_id("vm")
    monkeypatch.delenv("DUALTRACK_PUSHGATEWAY", raising=False)
    monkeypatch.setenv("DUALTRACK_REMOTE_WRITE_URL", vm.url + daemons.REMOTE_WRITE_PATH)
    monitor = TrainingMonitor(job="rw-test", run=run, instance="node-7", push_interval=0.2, record_path=False)
    trainer = Trainer()
    for _ in range(10):
        trainer.train_step(monitor)
    trainer.train_step(monitor, loss_scale=float("nan"), batch_id=4242)
    trainer.train_step(monitor)

    def firing() -> list[dict]:
        alerts = requests.get(rules.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        return [a for a in alerts if a["name"] == "TrainingLossNonFinite" and a["labels"].get("run") == run
                and a["state"] == "firing"]

    alert, = processes.wait_until(firing, 90, what="vmalert firing TrainingLossNonFinite")
    assert "since step 10, batch 4242" in alert["annotations"]["description"]
    monitor.close()
    assert monitor._writer.failures == 0
    result = daemons.wait_for_series(vm.url, f'training_steps_total{{run="{run}"}} == 12', 60)
    assert {k: result[0]["metric"][k] for k in ("job", "run", "rank", "instance")} == \
        {"job": "rw-test", "run": run, "rank": "0", "instance": "node-7"}
    daemons.wait_for_series(vm.url, f'training_run_state{{run="{run}",state="finished"}} == 1', 30)
    buckets = daemons.query(vm.url, f'training_step_duration_seconds_bucket{{run="{run}",le="+Inf"}}')
    assert [float(b["value"][1]) for b in buckets] == [11.0]  # 12 steps, 11 durations between them
