"""The alert path of the e2e and fault tests: Pushgateway -> Prometheus (the repo's rules) ->
Alertmanager (the repo's routes and inhibitions, short test timings) -> a loopback webhook."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from stack import processes
from stack.processes import Service, WebhookReceiver
from tests.support.hook import Trainer, run_id
from trainer_hook import TrainingMonitor

# Prometheus resends firing alerts every evaluation (1 s) instead of every minute.
PROMETHEUS_TEST_ARGS = ["--rules.alert.resend-delay=1s"]


@dataclass
class AlertPipeline:
    pushgateway: Service
    prometheus: Service
    alertmanager: Service
    webhook: WebhookReceiver

    def alert_states(self, alertname: str, **labels: str) -> list[str]:
        """States ("pending", "firing") of Prometheus' active alerts matching `alertname` and `labels`."""
        alerts = requests.get(self.prometheus.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        return [a["state"] for a in alerts if a["labels"]["alertname"] == alertname
                and all(a["labels"].get(k) == v for k, v in labels.items())]

    def wait_firing(self, alertname: str, timeout: float = 30.0, **labels: str) -> None:
        processes.wait_until(lambda: self.alert_states(alertname, **labels) == ["firing"], timeout,
                             what=f"{alertname} {labels} firing in Prometheus")

    def notification_errors(self) -> float:
        """Prometheus' own count of failed sends to Alertmanagers (from its /metrics)."""
        text = requests.get(self.prometheus.url + "/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("prometheus_notifications_errors_total"))

    def rule_count(self) -> int:
        groups = requests.get(self.prometheus.url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        return sum(len(group["rules"]) for group in groups)


def start_pipeline(workdir: Path, start_service: Callable[[Service], Service], webhook: WebhookReceiver,
                   exporter_targets: list[str] | None = None, group_wait: str = "1s",
                   group_interval: str = "1s", alertmanager_env: dict[str, str] | None = None) -> AlertPipeline:
    """Start the pipeline: scrape and evaluation every second, Alertmanager group_wait 1 s
    (`alertmanager_env`: more of render-config.sh's variables, e.g. notification channels)."""
    pushgateway = start_service(processes.pushgateway(workdir))
    am_config = processes.render_alertmanager_config(workdir, {"DUALTRACK_WEBHOOK_URL": webhook.url,
                                                               **(alertmanager_env or {})},
                                                     group_wait=group_wait, group_interval=group_interval)
    alertmanager = start_service(processes.alertmanager(workdir, am_config))
    prom_config = processes.render_prometheus_config(
        workdir, {processes.PUSHGATEWAY_JOB: [pushgateway.address],
                  processes.EXPORTER_JOB: exporter_targets or []},
        scrape_interval="1s", evaluation_interval="1s", alertmanagers=[alertmanager.address])
    prometheus = start_service(processes.prometheus(workdir, prom_config, extra_args=PROMETHEUS_TEST_ARGS))
    return AlertPipeline(pushgateway, prometheus, alertmanager, webhook)


@dataclass
class NonFiniteRun:
    """A real torch run with the hook that logs one NaN loss; the monitor stays open (running)."""

    monitor: TrainingMonitor
    trainer: Trainer
    run: str
    nan_step: int = -1
    nan_batch_id: int = 4242

    @property
    def labels(self) -> dict[str, str]:
        return {"job": "alerting-test", "run": self.run, "rank": "0", "instance": socket.gethostname()}

    @classmethod
    def start(cls, pipeline: AlertPipeline, record_path: Path, **monitor_args: Any) -> NonFiniteRun:
        run = run_id("alert")
        monitor = TrainingMonitor(job="alerting-test", run=run, pushgateway=pipeline.pushgateway.url,
                                  push_interval=0.5, record_path=record_path, **monitor_args)
        return cls(monitor, Trainer(), run)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.trainer.train_step(self.monitor)

    def diverge(self, healthy_steps: int = 10) -> float:
        """Train `healthy_steps` steps, then one whose loss is NaN; returns when that was logged."""
        self.train(healthy_steps)
        self.nan_step = self.trainer.step
        self.trainer.train_step(self.monitor, loss_scale=float("nan"), batch_id=self.nan_batch_id)
        return time.time()
