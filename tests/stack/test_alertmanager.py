"""alertmanager.yml: amtool checks, severity routing, webhook URLs from the environment, and the
inhibition rules as a real Alertmanager applies them."""
from __future__ import annotations

import subprocess
from datetime import datetime, timedelta, timezone

import pytest
import requests
import yaml

from stack import processes

CONFIG = processes.ALERTMANAGER_YML


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["amtool", *args], capture_output=True, text=True, timeout=30)


def test_config_passes_amtool_check(tmp_path):
    for path in (CONFIG, processes.render_alertmanager_config(tmp_path, {"DUALTRACK_WEBHOOK_URL": "http://h:1/x"})):
        result = amtool("check-config", str(path))
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("labels, receiver", [
    (["alertname=TrainingLossNonFinite", "severity=critical", "run=r1"], "critical"),
    (["alertname=GPULost", "severity=critical", "instance=h:9942", "gpu=0"], "critical"),
    (["alertname=TrainingDataLoaderBottleneck", "severity=warning", "run=r1"], "default"),
    (["alertname=Other", "severity=info"], "default"),
])
def test_routes_by_severity(labels, receiver):
    result = amtool("config", "routes", "test", f"--config.file={CONFIG}", f"--verify.receivers={receiver}", *labels)
    assert result.returncode == 0, result.stdout + result.stderr


def urls(path) -> dict[str, str]:
    config = yaml.safe_load(path.read_text())
    return {r["name"]: r["webhook_configs"][0]["url"] for r in config["receivers"]}


def test_webhook_urls_come_from_the_environment(tmp_path):
    odd = "https://hooks.example.com/a?b=1&c=x|y\\z"
    assert urls(processes.render_alertmanager_config(tmp_path, {"DUALTRACK_WEBHOOK_URL": odd})) == \
        {"default": odd, "critical": odd}
    assert urls(processes.render_alertmanager_config(tmp_path, {"DUALTRACK_WEBHOOK_URL": "http://a/1",
                                                                "DUALTRACK_CRITICAL_WEBHOOK_URL": "http://b/2"})) == \
        {"default": "http://a/1", "critical": "http://b/2"}


def test_render_script_execs_the_command_with_the_rendered_file(tmp_path):
    out = tmp_path / "am.yml"
    result = subprocess.run(["sh", str(processes.ALERTMANAGER_RENDER), str(CONFIG), str(out), "cat", str(out)],
                            capture_output=True, text=True, env={"DUALTRACK_WEBHOOK_URL": "http://hook:5001/x"},
                            timeout=10)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("url: http://hook:5001/x") == 2
    assert subprocess.run(["sh", str(processes.ALERTMANAGER_RENDER)], capture_output=True).returncode == 2


def without_timings(route: dict) -> dict:
    return {key: [without_timings(r) for r in value] if key == "routes" else value
            for key, value in route.items() if key not in ("group_wait", "group_interval", "repeat_interval")}


def test_test_timings_keep_routes_and_inhibitions(tmp_path):
    original = yaml.safe_load(CONFIG.read_text())
    rendered = yaml.safe_load(processes.render_alertmanager_config(
        tmp_path, group_wait="1s", group_interval="1s", repeat_interval="1m").read_text())
    assert rendered["inhibit_rules"] == original["inhibit_rules"]
    assert without_timings(rendered["route"]) == without_timings(original["route"])
    assert rendered["route"]["group_wait"] == rendered["route"]["routes"][0]["group_wait"] == "1s"


def test_inhibitions_in_a_real_alertmanager(tmp_path, start_service):
    am = start_service(processes.alertmanager(tmp_path, processes.render_alertmanager_config(tmp_path)))
    gpu0 = {"job": "dualtrack-exporter", "instance": "h:9942", "gpu": "0", "uuid": "GPU-0"}
    gpu1 = {**gpu0, "gpu": "1", "uuid": "GPU-1"}
    run = {"job": "train", "run": "r1", "rank": "0", "instance": "h"}
    alerts = {
        "lost": {"alertname": "GPULost", "severity": "critical", **gpu0},
        "hot-lost-gpu": {"alertname": "GPUTemperatureHigh", "severity": "warning", **gpu0},
        "hot-other-gpu": {"alertname": "GPUTemperatureHigh", "severity": "critical", **gpu1},
        "hot-other-gpu-warning": {"alertname": "GPUTemperatureHigh", "severity": "warning", **gpu1},
        "down": {"alertname": "NVMLExporterDown", "severity": "critical", "job": "dualtrack-exporter",
                 "instance": "h2:9942"},
        "xid-down-host": {"alertname": "GPUXidError", "severity": "warning", **gpu0, "instance": "h2:9942",
                          "uuid": "GPU-9", "xid": "13"},
        "nan": {"alertname": "TrainingLossNonFinite", "severity": "critical", **run},
    }
    ends = (datetime.now(timezone.utc) + timedelta(minutes=5)).isoformat()
    requests.post(am.url + "/api/v2/alerts", json=[{"labels": labels, "endsAt": ends} for labels in alerts.values()],
                  timeout=5).raise_for_status()

    def inhibited() -> dict[str, bool] | None:
        got = requests.get(am.url + "/api/v2/alerts", timeout=5).json()
        if len(got) < len(alerts):
            return None
        by_labels = {tuple(sorted(a["labels"].items())): bool(a["status"]["inhibitedBy"]) for a in got}
        return {name: by_labels[tuple(sorted(labels.items()))] for name, labels in alerts.items()}

    expected = {"lost": False, "hot-lost-gpu": True, "hot-other-gpu": False, "hot-other-gpu-warning": True,
                "down": False, "xid-down-host": True, "nan": False}
    processes.wait_until(lambda: inhibited() == expected, 10, what=f"inhibitions {expected}")


def test_groups_training_alerts_by_run_and_gpu_alerts_by_host(tmp_path, start_service):
    am = start_service(processes.alertmanager(tmp_path, processes.render_alertmanager_config(tmp_path)))
    ranks = [{"alertname": "TrainingLossNonFinite", "severity": "critical", "job": "train", "run": "r1",
              "rank": str(rank), "instance": f"node{rank // 4}"} for rank in range(8)]
    other_run = {**ranks[0], "run": "r2"}
    gpus = [{"alertname": "GPUTemperatureHigh", "severity": "warning", "job": "dualtrack-exporter",
             "instance": "h:9942", "gpu": str(gpu), "uuid": f"GPU-{gpu}"} for gpu in range(4)]
    other_host = {**gpus[0], "instance": "h2:9942"}
    alerts = [*ranks, other_run, *gpus, other_host]
    ends = (datetime.now(timezone.utc) + timedelta(minutes=5)).isoformat()
    requests.post(am.url + "/api/v2/alerts", json=[{"labels": labels, "endsAt": ends} for labels in alerts],
                  timeout=5).raise_for_status()

    def groups() -> dict[tuple, int] | None:
        got = requests.get(am.url + "/api/v2/alerts/groups", timeout=5).json()
        sizes = {tuple(sorted(g["labels"].items())): len(g["alerts"]) for g in got}
        return sizes if sum(sizes.values()) == len(alerts) else None

    assert processes.wait_until(groups, 10, what="all alerts grouped") == {
        (("alertname", "TrainingLossNonFinite"), ("job", "train"), ("run", "r1")): 8,
        (("alertname", "TrainingLossNonFinite"), ("job", "train"), ("run", "r2")): 1,
        (("alertname", "GPUTemperatureHigh"), ("instance", "h:9942")): 4,
        (("alertname", "GPUTemperatureHigh"), ("instance", "h2:9942")): 1,
    }
