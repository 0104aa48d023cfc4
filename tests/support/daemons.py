"""Test helpers around the stack's daemons (stack/processes.py starts them for the demo and the tests):
PromQL queries through dualtrack's one Prometheus client, waiting for series, and the second
remote-write engine (VictoriaMetrics, vmalert) that only the tests run."""
from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import pytest
import requests

from dualtrack.prometheus import Prometheus
from stack.processes import RULES_DIR, Service, _binary, free_port, wait_until
from trainer_hook.connection import Endpoint

#: The flag that makes Prometheus accept remote write at /api/v1/write (the hook's DUALTRACK_REMOTE_WRITE_URL).
REMOTE_WRITE_RECEIVER = "--web.enable-remote-write-receiver"
REMOTE_WRITE_PATH = "/api/v1/write"  # the same path on Prometheus and VictoriaMetrics


def victoria_metrics(workdir: Path, port: int | None = None) -> Service:
    """A single-node VictoriaMetrics (not yet started): remote write at REMOTE_WRITE_PATH, the Prometheus
    query API at /api/v1/query. Samples are visible to queries 1 s after they arrive (30 s by default)."""
    port = port or free_port()
    data = workdir / "victoria-metrics-data"
    data.mkdir(parents=True, exist_ok=True)
    argv = [_binary("victoria-metrics"), f"-httpListenAddr=127.0.0.1:{port}", f"-storageDataPath={data}",
            "-search.latencyOffset=1s", "-loggerLevel=WARN"]
    return Service("victoria-metrics", argv, port, workdir / "victoria-metrics.log", ready_path="/health")


def vmalert(workdir: Path, datasource_url: str, notifier_url: str, port: int | None = None,
            evaluation_interval: str = "1s") -> Service:
    """VictoriaMetrics' rule evaluator (not yet started) over the repo's rules/, reading `datasource_url`,
    writing recording rules' results back there, sending alerts to the Alertmanager at `notifier_url`."""
    port = port or free_port()
    argv = [_binary("vmalert"), f"-httpListenAddr=127.0.0.1:{port}", f"-rule={RULES_DIR}/*.yml",
            f"-datasource.url={datasource_url}", f"-remoteWrite.url={datasource_url}",
            f"-notifier.url={notifier_url}", f"-evaluationInterval={evaluation_interval}", "-loggerLevel=WARN"]
    return Service("vmalert", argv, port, workdir / "vmalert.log", ready_path="/health")


def query(prometheus_url: str, expr: str, timeout: float = 5.0, at: float | None = None) -> list[dict]:
    """Instant query (at unix time `at`, default now) through dualtrack's Prometheus client: the result
    vector (list of {metric, value: (time, value text)}); raises QueryError."""
    return Prometheus(Endpoint(prometheus_url), timeout).query(expr, at)


def wait_for_series(prometheus_url: str, expr: str, timeout: float = 60.0,
                    predicate: Callable[[list[dict]], bool] = bool) -> list[dict]:
    """Wait until `expr` returns a result that satisfies `predicate`; return that result."""
    def probe() -> list[dict] | None:
        result = query(prometheus_url, expr)
        return result if predicate(result) else None
    return wait_until(probe, timeout, interval=0.25, what=f"PromQL {expr!r}")


def evaluated_since(rules: requests.Response, group: str | None, since: float) -> bool:
    """Whether Prometheus evaluated rule group `group` (every group, for None) after `since` (Unix time,
    to the second), by its answer to /api/v1/rules."""
    groups = rules.json()["data"]["groups"]
    if group is not None:
        [last] = [g["lastEvaluation"] for g in groups if g["name"] == group]
        times = [last]
    else:
        times = [g["lastEvaluation"] for g in groups]
    return bool(times) and all(
        datetime.strptime(last[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp() > since + 1
        for last in times)


def wait_for_rule_evaluations(prometheus_url: str, after: float, auth: tuple[str, str] | None = None,
                              timeout: float = 60.0) -> None:
    """Wait until Prometheus evaluated every rule group after `after` (Unix time)."""
    wait_until(lambda: evaluated_since(requests.get(f"{prometheus_url}/api/v1/rules", auth=auth, timeout=5), None,
                                       after), timeout, interval=0.5, what="every rule group to be evaluated")


def promtool_check(text: str) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed")
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
