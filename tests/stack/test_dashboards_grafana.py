"""Grafana itself provisions both dashboards and serves them without errors (where grafana-server is
installed; skipped otherwise: Debian has no grafana package, the compose stack runs Grafana's image)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from stack import processes
from stack.demo import grafana, grafana_binary, render_grafana_provisioning
from tests.support.paths import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    grafana_binary() is None, reason="grafana-server not installed")]

PASSWORD = "dashboards-test-password"


def test_grafana_provisions_both_dashboards_without_errors(tmp_path: Path) -> None:
    prometheus = processes.prometheus(tmp_path, processes.render_prometheus_config(tmp_path, {})).start()
    provisioning = render_grafana_provisioning(tmp_path, prometheus.url, "http://127.0.0.1:9", "15s")
    service = grafana(grafana_binary(), tmp_path, provisioning, processes.free_port(), PASSWORD)
    try:
        service.start(timeout=120)
        auth = ("admin", PASSWORD)
        found = requests.get(f"{service.url}/api/search", params={"type": "dash-db"}, auth=auth, timeout=10).json()
        assert {d["uid"] for d in found} >= {"dualtrack-training-run", "dualtrack-gpu-fleet"}, found
        for uid in ("dualtrack-training-run", "dualtrack-gpu-fleet"):
            response = requests.get(f"{service.url}/api/dashboards/uid/{uid}", auth=auth, timeout=10)
            assert response.status_code == 200, response.text
            dashboard = response.json()["dashboard"]
            repo = json.loads((REPO / "dashboards" / f"{uid.removeprefix('dualtrack-')}.json").read_text())
            assert len(dashboard["panels"]) == len(repo["panels"])
        health = requests.get(f"{service.url}/api/datasources/uid/dualtrack-prometheus/health", auth=auth,
                              timeout=10).json()
        assert health.get("status") == "OK", health
        errors = [line for line in service.log_tail(10_000).splitlines()
                  if "level=error" in line and ("dashboard" in line or "provisioning" in line)]
        assert not errors, "\n".join(errors)
    finally:
        service.stop()
        prometheus.stop()
