"""Prometheus rules: promtool checks and unit tests, and the alert contract (names, labels, runbooks)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from stack import processes
from tests.support.paths import REPO

RULE_FILES = sorted((REPO / "rules").glob("*.yml"))
RULE_TESTS = sorted((REPO / "tests" / "stack" / "rules").glob("*.yml"))
RUNBOOK = REPO / "docs" / "alerts.md"

CONTRACT = {
    "TrainingDataLoaderBottleneck", "TrainingGradientExplosion", "TrainingLossNonFinite",
    "GPUMemoryLeakSuspected", "TrainingStalled", "TrainingMetricsStale", "GPUThermalThrottling",
    "GPUTemperatureHigh", "GPUXidError", "GPULost", "NVMLExporterDown", "TrainingGPUIdleNotInputBound",
    "TrainingLossScaleCollapse", "TrainingStragglerRank", "GPUSuspectedFaulty",
    "TrainingRankHung", "TrainingPauseTooLong", "TrainingReplicaDivergence",
}
RUNBOOKS_LABEL = processes.RUNBOOKS_URL_LABEL
GRAFANA_LABEL = processes.GRAFANA_URL_LABEL
TRAINING_DASHBOARD = REPO / "dashboards" / "training-run.json"
# Every training alert links to the Training run dashboard, filtered to its job and run and to the hour
# before the evaluation (and 10 min after), from the Grafana URL in Prometheus' external label.
DASHBOARD_LINK = (
    f'{{{{ with $externalLabels.{GRAFANA_LABEL} }}}}{{{{ . }}}}/d/dualtrack-training-run'
    '?var-job={{ $labels.job | urlquery }}&var-run={{ $labels.run | urlquery }}'
    '&from={{ with query "(time() - 3600) * 1000" }}{{ . | first | value | printf "%.0f" }}{{ end }}'
    '&to={{ with query "(time() + 600) * 1000" }}{{ . | first | value | printf "%.0f" }}{{ end }}{{ end }}')


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def rules(kind: str) -> list[dict]:
    """Every alerting (`alert`) or recording (`record`) rule of the rule files."""
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if kind in rule]


def test_prometheus_config_as_rendered_passes_promtool(tmp_path):
    config = processes.render_prometheus_config(
        tmp_path, {processes.EXPORTER_JOB: ["127.0.0.1:9942"], processes.PUSHGATEWAY_JOB: ["127.0.0.1:9091"]},
        alertmanagers=["127.0.0.1:9093"])
    result = promtool("check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool passes a rule glob that matches nothing: make sure it loaded our files.
    for path in RULE_FILES:
        assert f"Checking {path}" in result.stdout


def test_rule_files_pass_promtool_lint():
    result = promtool("check", "rules", "--lint=all", "--lint-fatal", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("rule_test", RULE_TESTS, ids=lambda path: path.stem)
def test_rule_unit_tests_pass(rule_test):
    result = promtool("test", "rules", str(rule_test))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_contract_alert_exists():
    assert CONTRACT <= {rule["alert"] for rule in rules("alert")}


@pytest.mark.parametrize("rule", rules("alert"), ids=lambda rule: f"{rule['alert']}-{rule['labels']['severity']}")
def test_alert_has_severity_annotations_and_runbook_section(rule):
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    annotations = rule["annotations"]
    assert {"summary", "description", "runbook_url"} <= annotations.keys()
    assert "{{" in annotations["description"], "the description must name the run or GPU"
    # Absolute: the runbooks page from Prometheus' external label, then the alert's section.
    assert annotations["runbook_url"] == f"{{{{ $externalLabels.{RUNBOOKS_LABEL} }}}}#{rule['alert'].lower()}"
    assert f"\n## {rule['alert']}\n" in RUNBOOK.read_text()


def test_runbooks_url_is_one_absolute_setting_kept_out_of_alert_labels():
    config = yaml.safe_load((REPO / "prometheus.yml").read_text())
    url = urlparse(config["global"]["external_labels"][RUNBOOKS_LABEL])
    assert url.scheme == "https" and url.netloc and url.path.endswith("/alerts.md"), url
    assert {"action": "labeldrop", "regex": RUNBOOKS_LABEL} in config["alerting"]["alert_relabel_configs"]


def test_every_training_alert_links_to_its_run_on_the_training_dashboard():
    """An alert that names a run (its summary reads $labels.run) carries dashboard_url; the link's
    dashboard uid and variables are the Training run dashboard's."""
    training = [rule for rule in rules("alert") if "$labels.run" in rule["annotations"]["summary"]]
    assert {"TrainingDataLoaderBottleneck", "TrainingStragglerRank", "GPUMemoryLeakSuspected"} <= {
        rule["alert"] for rule in training}
    for rule in training:
        assert rule["annotations"].get("dashboard_url") == DASHBOARD_LINK, rule["alert"]
    dashboard = json.loads(TRAINING_DASHBOARD.read_text())
    assert dashboard["uid"] == "dualtrack-training-run"
    assert {"job", "run"} <= {variable["name"] for variable in dashboard["templating"]["list"]}


def test_grafana_url_is_one_setting_kept_out_of_alert_labels():
    """Compose: one variable, DUALTRACK_GRAFANA_URL, is both Grafana's root URL and the links' base
    (Prometheus expands it in its external label)."""
    config = yaml.safe_load((REPO / "prometheus.yml").read_text())
    assert config["global"]["external_labels"][GRAFANA_LABEL] == "${DUALTRACK_GRAFANA_URL}"
    assert {"action": "labeldrop", "regex": GRAFANA_LABEL} in config["alerting"]["alert_relabel_configs"]
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    assert "--enable-feature=expand-external-labels" in services["prometheus"]["command"]
    default = "${DUALTRACK_GRAFANA_URL:-http://localhost:3000}"
    assert services["prometheus"]["environment"]["DUALTRACK_GRAFANA_URL"] == default
    assert services["grafana"]["environment"]["GF_SERVER_ROOT_URL"] == default
    assert services["grafana"]["ports"] == ["${DUALTRACK_BIND:-127.0.0.1}:3000:3000"]  # the default's port


def test_a_rendered_config_can_point_the_links_at_its_own_grafana(tmp_path, monkeypatch):
    """The no-Docker demo renders prometheus.yml with its own Grafana's address (stack/demo.py)."""
    config = yaml.safe_load(processes.render_prometheus_config(
        tmp_path, {}, external_labels={GRAFANA_LABEL: "http://127.0.0.1:3999"}).read_text())
    labels = config["global"]["external_labels"]
    assert labels[GRAFANA_LABEL] == "http://127.0.0.1:3999"
    monkeypatch.setenv("DUALTRACK_GRAFANA_URL", "https://grafana.example.org")  # as Prometheus expands it
    expanded = yaml.safe_load(processes.render_prometheus_config(tmp_path, {}).read_text())
    assert expanded["global"]["external_labels"][GRAFANA_LABEL] == "https://grafana.example.org"
    assert labels[RUNBOOKS_LABEL] == yaml.safe_load((REPO / "prometheus.yml").read_text())[
        "global"]["external_labels"][RUNBOOKS_LABEL]


def test_kubernetes_prometheus_gets_the_same_link_settings():
    """The Operator's Prometheus (kube-prometheus-stack values shipped with the manifests) sets both
    external labels the annotations read, and drops them from alerts, as prometheus.yml does."""
    values = yaml.safe_load((REPO / "deploy" / "kubernetes" / "helm" / "kube-prometheus-stack-values.yaml").read_text())
    spec = values["prometheus"]["prometheusSpec"]
    # One setting: the chart's Grafana root URL is the links' base (a YAML anchor in the values file).
    assert spec["externalLabels"][GRAFANA_LABEL] == values["grafana"]["grafana.ini"]["server"]["root_url"]
    for label in (RUNBOOKS_LABEL, GRAFANA_LABEL):
        assert urlparse(spec["externalLabels"][label]).scheme == "https", label
        assert {"action": "labeldrop", "regex": label} in spec["additionalAlertRelabelConfigs"]


def test_every_alert_fires_in_a_unit_test_and_healthy_runs_stay_silent():
    fired, silent_checks = set(), []
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            fired |= {t["alertname"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
            silent_checks += [t["expr"] for t in case.get("promql_expr_test", [])
                              if "ALERTS" in t["expr"] and not t["exp_samples"]]
    assert {rule["alert"] for rule in rules("alert")} <= fired
    assert "count_over_time(ALERTS[3h])" in silent_checks  # the healthy run: no alert at all
    # a finished run: nothing but TrainingLossNonFinite for the NaN in its last push
    assert 'count_over_time(ALERTS{alertname=~"Training.*",alertname!="TrainingLossNonFinite"}[90m])' in silent_checks


def test_recording_rule_names_and_uses():
    recorded = {rule["record"] for rule in rules("record")}
    for name in recorded:
        assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", name), name
    used = {name for rule in rules("alert") + rules("record")
            for name in re.findall(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", rule["expr"])}
    assert used <= recorded, f"used but never recorded: {used - recorded}"


def test_prometheus_loads_every_rule_file_and_no_test_file():
    config = yaml.safe_load((REPO / "prometheus.yml").read_text())
    assert [str(Path(pattern).relative_to("/etc/prometheus/rules")) for pattern in config["rule_files"]] == [
        "*.yml", "dcgm/*.yml"]
    assert not any("test" in path.name for path in RULE_FILES)


GPU_SELECTOR = re.compile(r'(?<![\w:])(nvml_\w+)(?![\w:])(\{[^{}]*\})?')


def test_every_gpu_series_a_rule_reads_is_the_exporters():
    """Only the exporter writes GPU series: every rule reads nvml_* from its scrape job alone, so the same
    names pushed (another job) or remote-written under another job fire and record nothing."""
    exporter = f'job="{processes.EXPORTER_JOB}"'
    every = [rule for path in sorted((REPO / "rules").rglob("*.yml"))
             for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]
    assert any(rule.get("record", "").startswith("DCGM_FI_") for rule in every)  # rules/dcgm/ too
    unselected = [(rule.get("alert") or rule["record"], found.group(0))
                  for rule in every for found in GPU_SELECTOR.finditer(rule["expr"])
                  if exporter not in (found.group(2) or "")]
    assert unselected == []
