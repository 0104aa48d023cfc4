"""Remote write on two real engines: Debian's Prometheus with --web.enable-remote-write-receiver (the
project's rules evaluate the remote-written series, and hold the same series and labels as a run
pushed through the Pushgateway and scraped with honor_labels), and Debian's VictoriaMetrics (the run's
series are queryable through its Prometheus API, and vmalert fires the same alert from the same rules)."""
from __future__ import annotations

import time

import cramjam
import pytest
import requests
import yaml

from stack import processes
from tests.support import daemons
from tests.support.alerting import PROMETHEUS_TEST_ARGS
from tests.support.certs import bcrypt_hash
from tests.support.hook import Trainer, run_id
from trainer_hook import TrainingMonitor
from trainer_hook.remote_write import messages

pytestmark = pytest.mark.e2e

#: Series only the Pushgateway adds to what it serves, and the training thread's frame, which a rank
#: reports only while it has logged no step for two push intervals (here: whenever the test is slow).
NOT_COMPARED = {"push_time_seconds", "push_failure_time_seconds", "training_rank_frame_info"}


def series(prometheus_url: str, run: str) -> set[tuple[tuple[str, str], ...]]:
    """Every series the hook gave `run` (not the recording rules'), without the run and launch labels (so
    two runs compare)."""
    answer = requests.get(f"{prometheus_url}/api/v1/series", timeout=10,
                          params={"match[]": f'{{run="{run}",__name__=~"training_.*"}}'})
    answer.raise_for_status()
    return {tuple(sorted((k, v) for k, v in labels.items() if k not in ("run", "launch")))
            for labels in answer.json()["data"]
            if labels["__name__"] not in NOT_COMPARED}


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
    assert "from step 10 (batch 4242)" in alert["annotations"]["description"]
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
    assert "from step 10 (batch 4242)" in alert["annotations"]["description"]
    monitor.close()
    assert monitor._writer.failures == 0
    result = daemons.wait_for_series(vm.url, f'training_steps_total{{run="{run}"}} == 12', 60)
    assert {k: result[0]["metric"][k] for k in ("job", "run", "rank", "instance")} == \
        {"job": "rw-test", "run": run, "rank": "0", "instance": "node-7"}
    daemons.wait_for_series(vm.url, f'training_run_state{{run="{run}",state="finished"}} == 1', 30)
    buckets = daemons.query(vm.url, f'training_step_duration_seconds_bucket{{run="{run}",le="+Inf"}}')
    assert [float(b["value"][1]) for b in buckets] == [11.0]  # 12 steps, 11 durations between them


def test_a_receiver_behind_basic_auth_takes_only_its_writers_and_their_gpu_series_fire_nothing(tmp_path,
                                                                                            start_service):
    """Remote write has no per-series rights: whoever may write may write any series. The shipped answer
    (docs/security.md): the receiver behind authentication, its password the training jobs' alone, and
    the GPU rules reading the exporter's job only. A write without the password is refused (401); the
    hook with its remote-write credentials lands; an XID 79 a writer sends under its own job fires no
    GPUXidError."""
    web = tmp_path / "prometheus-web.yml"
    web.write_text(yaml.safe_dump({"basic_auth_users": {"trainer": bcrypt_hash("rw-pass", cost=4)}}))
    config = processes.render_prometheus_config(tmp_path, {}, scrape_interval="1s", evaluation_interval="1s")
    prometheus = start_service(processes.prometheus(
        tmp_path, config, extra_args=[*PROMETHEUS_TEST_ARGS, daemons.REMOTE_WRITE_RECEIVER], web_config=web,
        auth=("trainer", "rw-pass")))
    url = prometheus.url + daemons.REMOTE_WRITE_PATH
    request = messages()["WriteRequest"]()
    series = request.timeseries.add()
    for name, value in sorted({"__name__": "nvml_gpu_xid_errors_total", "job": "train", "instance": "victim:9942",
                               "gpu": "0", "uuid": "GPU-victim", "xid": "79"}.items()):
        series.labels.add(name=name, value=value)
    series.samples.add(value=3, timestamp=int(time.time() * 1000))
    body = bytes(cramjam.snappy.compress_raw(request.SerializeToString()))
    headers = {"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
               "X-Prometheus-Remote-Write-Version": "0.1.0"}
    assert requests.post(url, data=body, headers=headers, timeout=10).status_code == 401
    assert requests.post(url, data=body, headers=headers, auth=("trainer", "rw-pass"), timeout=10).status_code == 204
    run = run_id("rw-auth")
    monitor = TrainingMonitor(job="rw-test", run=run, push_interval=0.5, remote_write_url=url,
                              remote_write_basic_auth=("trainer", "rw-pass"), allow_insecure_credentials=True,
                              record_path=tmp_path / "rw.jsonl")
    trainer = Trainer()
    for _ in range(3):
        trainer.train_step(monitor)
    monitor.close()
    auth = ("trainer", "rw-pass")
    processes.wait_until(lambda: requests.get(prometheus.url + "/api/v1/query", auth=auth, timeout=5, params={
        "query": f'training_run_state{{run="{run}",state="finished"}} == 1'}).json()["data"]["result"], 30,
        what="the hook's remote-written series")
    assert monitor._writer.failures == 0
    stored = requests.get(prometheus.url + "/api/v1/query", auth=auth, timeout=5,
                          params={"query": "nvml_gpu_xid_errors_total"}).json()["data"]["result"]
    assert [s["metric"]["job"] for s in stored] == ["train"]  # written, but not the exporter's

    daemons.wait_for_rule_evaluations(prometheus.url, time.time() + 2, auth=auth)
    alerts = requests.get(prometheus.url + "/api/v1/alerts", auth=auth, timeout=5).json()["data"]["alerts"]
    assert [a for a in alerts if a["labels"]["alertname"] == "GPUXidError"] == []
