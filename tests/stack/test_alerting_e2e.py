"""Alerts end to end: the training hook (real torch) or the exporter (simulated GPUs) -> Prometheus
with the repo's rules -> Alertmanager with the repo's routes -> a webhook on loopback."""
from __future__ import annotations

import json
import re
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from stack import processes
from tests.support import daemons
from tests.support.alerting import NonFiniteRun, start_pipeline
from tests.support.exporter import faulty_exporter
from tests.support.hook import Trainer, run_id
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.e2e


def test_nonfinite_loss_reaches_the_webhook_and_resolves_when_the_run_finishes(
        tmp_path, start_service, webhook_receiver, monkeypatch):
    grafana = "https://grafana.example.org"
    monkeypatch.setenv("DUALTRACK_GRAFANA_URL", grafana)  # prometheus.yml's one setting, as compose sets it
    pipeline = start_pipeline(tmp_path, start_service, webhook_receiver)
    run = NonFiniteRun.start(pipeline, tmp_path / "record.jsonl", delete_after=2)
    with run.monitor:
        run.train(20)
        daemons.wait_for_series(pipeline.prometheus.url, f'training_steps_total{{run="{run.run}"}} >= 20', 30)
        logged_at = run.diverge(healthy_steps=0)
        run.train(5)
        notification, alert = webhook_receiver.wait_for_alert("TrainingLossNonFinite", run=run.run, timeout=60)
        latency = notification["received_at"] - logged_at
        print(f"non-finite loss logged -> webhook: {latency:.1f} s")
        assert latency < 120  # the detection target: within 2 minutes of the push

    assert notification["receiver"] == "critical"
    # Prometheus adds its external label `monitor` to what it sends.
    assert alert["labels"] == {"alertname": "TrainingLossNonFinite", "severity": "critical", "monitor": "dualtrack",
                               **run.labels}
    description = alert["annotations"]["description"]
    # The state when it fired: the streak it names, and the steps the run has been finite since.
    assert re.search(rf"was non-finite from step {run.nan_step} \(batch {run.nan_batch_id}\) to step {run.nan_step} "
                     r"\(1 step\), finite for \d+ steps? since", description), description
    assert alert["annotations"]["summary"] == f"Non-finite values in run {run.run} rank 0"
    # A CPU run reports no GPU: the alert says so, and names no GPU of the run.
    assert " ".join(alert["annotations"]["infra_cause"].split()) == \
        f"none: the run reports no GPU; dualtrack explain {run.run} has the timeline."
    # An absolute link from prometheus.yml's one setting; the setting itself is not an alert label.
    external_labels = yaml.safe_load(processes.PROMETHEUS_YML.read_text())["global"]["external_labels"]
    runbooks = external_labels["dualtrack_runbooks_url"]
    assert alert["annotations"]["runbook_url"] == runbooks + "#traininglossnonfinite"
    # The Training run dashboard filtered to the run, from an hour before the evaluation to 10 min after.
    link = urlsplit(alert["annotations"]["dashboard_url"])
    assert f"{link.scheme}://{link.netloc}{link.path}" == grafana + "/d/dualtrack-training-run"
    query = parse_qs(link.query)
    assert query["var-job"] == [run.labels["job"]] and query["var-run"] == [run.run]
    window = int(query["from"][0]) / 1000, int(query["to"][0]) / 1000
    assert window[0] < logged_at < notification["received_at"] < window[1]
    # The run finished (closing the monitor pushed state="finished", kept on the Pushgateway for its
    # delete_after): the alert resolves once the run's group is deleted.
    webhook_receiver.wait_for_alert("TrainingLossNonFinite", status="resolved", run=run.run, timeout=90)


def test_lost_gpu_reaches_the_webhook(tmp_path, start_service, webhook_receiver):
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({"faults": [{"gpu": 1, "function": "*", "error": "GpuIsLost", "at": 1}]}))
    exporter = start_service(faulty_exporter(
        tmp_path, ["--simulate=healthy", f"--faults={plan}", "--sample-interval=0.2"]))
    pipeline = start_pipeline(tmp_path, start_service, webhook_receiver, exporter_targets=[exporter.address])

    notification, alert = webhook_receiver.wait_for_alert("GPULost", gpu="1", timeout=60)
    assert notification["receiver"] == "critical"
    assert alert["labels"]["instance"] == exporter.address
    assert alert["labels"]["uuid"].startswith("GPU-")
    assert f"GPU 1 ({alert['labels']['uuid']}) on {exporter.address}" in alert["annotations"]["description"]
    assert pipeline.alert_states("GPULost", gpu="0") == []


def test_eight_ranks_going_nan_together_send_one_notification(tmp_path, start_service, webhook_receiver):
    # group_wait as in production (long enough for every rank's alert to join the group); a long
    # group_interval so that a second notification could only come from a second group.
    pipeline = start_pipeline(tmp_path, start_service, webhook_receiver, group_wait="5s", group_interval="10m")
    run = run_id("allranks")
    monitors = [TrainingMonitor(job="alerting-test", run=run, rank=rank, pushgateway=pipeline.pushgateway.url,
                                push_interval=0.5, record_path=tmp_path / f"rank{rank}.jsonl") for rank in range(8)]
    trainers = [Trainer(seed=rank) for rank in range(8)]
    try:
        for _ in range(3):
            for trainer, monitor in zip(trainers, monitors):
                trainer.train_step(monitor)
        daemons.wait_for_series(pipeline.prometheus.url, f'count(training_steps_total{{run="{run}"}} >= 3) == 8', 30)
        for trainer, monitor in zip(trainers, monitors):
            trainer.train_step(monitor, loss_scale=float("nan"))

        def delivered() -> list[dict]:
            alerts = [alert for payload in webhook_receiver.notifications() for alert in payload["alerts"]
                      if alert["labels"]["alertname"] == "TrainingLossNonFinite"]
            return alerts if len(alerts) >= 8 else []
        processes.wait_until(delivered, 60, what="8 TrainingLossNonFinite alerts at the webhook")
    finally:
        for monitor in monitors:
            monitor.close()

    notifications = [payload for payload in webhook_receiver.notifications()
                     if payload["groupLabels"].get("alertname") == "TrainingLossNonFinite"]
    assert len(notifications) == 1, [sorted(a["labels"]["rank"] for a in n["alerts"]) for n in notifications]
    notification = notifications[0]
    assert notification["groupLabels"] == {"alertname": "TrainingLossNonFinite", "job": "alerting-test", "run": run}
    assert sorted(alert["labels"]["rank"] for alert in notification["alerts"]) == [str(rank) for rank in range(8)]


def test_a_short_run_that_goes_nan_and_finishes_notifies_once(tmp_path, start_service, webhook_receiver):
    """The NaN and the end are in the run's one last push (no push saw it running with the NaN): the
    finished run's last push on the Pushgateway fires TrainingLossNonFinite, one notification, which
    resolves when the run's group is deleted."""
    pipeline = start_pipeline(tmp_path, start_service, webhook_receiver)
    run = run_id("shortnan")
    trainer = Trainer()
    with TrainingMonitor(job="alerting-test", run=run, pushgateway=pipeline.pushgateway.url, push_interval=600,
                         record_path=tmp_path / "short.jsonl", delete_after=10) as monitor:
        for _ in range(3):
            trainer.train_step(monitor)
        trainer.train_step(monitor, loss_scale=float("nan"))
    webhook_receiver.wait_for_alert("TrainingLossNonFinite", run=run, timeout=60)
    webhook_receiver.wait_for_alert("TrainingLossNonFinite", status="resolved", run=run, timeout=60)
    firing = [alert for payload in webhook_receiver.notifications() for alert in payload["alerts"]
              if alert["labels"].get("run") == run and alert["status"] == "firing"]
    assert len(firing) == 1, firing
