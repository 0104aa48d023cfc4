"""Stack faults: Prometheus restarted mid-run keeps its rules and its alerts; an Alertmanager that
was down when an alert fired delivers it once it is back."""
from __future__ import annotations

import time

import pytest
import yaml

from stack import processes
from tests.support import daemons
from tests.support.alerting import NonFiniteRun, start_pipeline

pytestmark = pytest.mark.fault


def test_prometheus_restart_mid_run_keeps_rules_history_and_alerts(tmp_path, start_service, webhook_receiver):
    pipeline = start_pipeline(tmp_path, start_service, webhook_receiver)
    rules = pipeline.rule_count()
    assert rules == sum(len(group["rules"]) for path in processes.RULES_DIR.rglob("*.yml")
                        for group in yaml.safe_load(path.read_text())["groups"])
    run = NonFiniteRun.start(pipeline, tmp_path / "record.jsonl")
    with run.monitor:
        run.diverge()
        pipeline.wait_firing("TrainingLossNonFinite", run=run.run)
        step = f'training_step{{run="{run.run}"}}'
        before_restart = time.time()
        assert daemons.query(pipeline.prometheus.url, step, at=before_restart)

        pipeline.prometheus.restart()
        run.train(10)  # the run goes on while Prometheus comes back

        assert pipeline.rule_count() == rules
        pipeline.wait_firing("TrainingLossNonFinite", run=run.run)  # again, after the restart
        # what was scraped before the restart is still there
        assert daemons.query(pipeline.prometheus.url, step, at=before_restart)
        daemons.wait_for_series(pipeline.prometheus.url, f'training_steps_total{{run="{run.run}"}} == 21', 30)


def test_alertmanager_down_then_up_delivers_the_pending_alert(tmp_path, start_service, webhook_receiver):
    pipeline = start_pipeline(tmp_path, start_service, webhook_receiver)
    pipeline.alertmanager.stop()
    run = NonFiniteRun.start(pipeline, tmp_path / "record.jsonl")
    with run.monitor:
        run.diverge()
        pipeline.wait_firing("TrainingLossNonFinite", run=run.run)
        # Prometheus tried to notify the Alertmanager that is down, and failed.
        processes.wait_until(lambda: pipeline.notification_errors() > 0, 30, what="failed notifications")
        assert webhook_receiver.notifications() == []

        pipeline.alertmanager.start()
        _, alert = webhook_receiver.wait_for_alert("TrainingLossNonFinite", run=run.run, timeout=30)
    assert f"from step {run.nan_step} (batch" in alert["annotations"]["description"]
