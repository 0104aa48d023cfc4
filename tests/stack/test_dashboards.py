"""Static checks of the provisioned Grafana dashboards and provisioning files (no daemons).

The dashboard JSON schema is Grafana's own (grafana-foundation-sdk, main branch, vendored in
tests/stack/schemas/); everything it cannot see (ids, layout, variables, units, datasource uids, metric
names, PromQL syntax) is checked here.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.support.dashboards import (
    DASHBOARDS,
    EXPORTER_METRICS,
    HOOK_METRICS,
    PROMETHEUS_METRICS,
    label_values_args,
    load,
    metric_names,
    panels,
    queries,
    query_variables,
    recording_rule_names,
    substitute,
    variable_names,
)
from tests.support.deploy import bind_mounts, services
from tests.support.paths import REPO

PROVISIONING = REPO / "grafana" / "provisioning"
SCHEMA = Path(__file__).resolve().parent / "schemas" / "grafana-dashboard.jsonschema.json"

DATASOURCE_UID = "dualtrack-prometheus"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}  # every query's: the datasource variable
# How the Training run's Infra panels select the run's GPUs, only while the run is live on them (state
# running and a push in the last 2 min): whole-GPU series join on uuid the exporter's GPU of each rank
# (job_run_rank_gpu:training_gpu_info:nvml: a MIG rank's parent GPU; the hook's training_gpu_info where
# the rule has no series yet, e.g. before it was deployed), one rank per GPU (MIG slices of one GPU
# share it); a MIG instance's series join on (uuid, gpu_instance) its rank.
LIVE = ('* on (job, run, rank, instance) group_left () (training_run_state{state="running"} == 1) '
        'and on (job, run, rank, instance) (time() - training_last_push_timestamp_seconds < 120)')
RUN_GPUS = ('topk by (uuid) (1, max by (uuid, run, rank) (('
            '(job_run_rank_gpu:training_gpu_info:nvml{job=~"$job", run=~"$run", instance=~"$instance"} '
            'and on (job, run, rank, instance, gpu) training_gpu_info{uuid=~"$gpu"}) '
            'or training_gpu_info{job=~"$job", run=~"$run", instance=~"$instance", uuid=~"$gpu"}) '
            f'{LIVE}))')
RUN_MIG_GPUS = ('max by (uuid, gpu_instance, run, rank) (job_run_rank_gpu:training_gpu_info:nvml{'
                'job=~"$job", run=~"$run", instance=~"$instance", gpu_instance!="", mig_uuid=~"$gpu"} '
                f'{LIVE})')
# Grafana unit ids the dashboards may use (all in Grafana's unit registry), plus custom suffixes.
UNITS = {"percentunit", "bytes", "watt", "celsius", "hertz", "s", "binBps", "none", "short", "joule"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s",
                     "__range_ms", "__from", "__to", "__dashboard", "__name"}


def provisioned(directory: str, key: str) -> list[dict]:
    """Entries under `key` of every provisioning file in grafana/provisioning/<directory>/."""
    items = []
    for path in sorted((PROVISIONING / directory).glob("*.y*ml")):
        config = yaml.safe_load(path.read_text())
        assert config["apiVersion"] == 1, path
        items.extend(config[key])
    return items


@pytest.fixture(params=DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def dashboard(request) -> dict:
    return load(request.param)


def test_both_dashboards_are_shipped():
    assert {p.name for p in DASHBOARDS} >= {"training-run.json", "gpu-fleet.json"}


def test_committed_dashboards_are_what_the_generator_builds(tmp_path):
    """dashboards/*.json are built by dashboards/generate.py (Grafana's typed builders): a hand edit of the
    JSON, or a generator change without the rebuilt JSON, fails here."""
    check = subprocess.run([sys.executable, str(REPO / "dashboards" / "generate.py"), "--check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    edited = tmp_path / "dashboards"
    shutil.copytree(REPO / "dashboards", edited)
    (edited / "gpu-fleet.json").write_text((edited / "gpu-fleet.json").read_text().replace("Hottest GPU", "Hot GPU"))
    stale = subprocess.run([sys.executable, str(edited / "generate.py"), "--check"], capture_output=True, text=True,
                           timeout=120)
    assert stale.returncode == 1 and "gpu-fleet.json" in stale.stderr and "training-run" not in stale.stderr


def test_dashboard_matches_grafana_schema(dashboard):
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator({**schema, "$ref": "#/definitions/Dashboard"})
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
              for e in validator.iter_errors(dashboard)]
    assert not errors, "\n".join(errors)


def test_schema_rejects_a_broken_dashboard(dashboard):
    """The vendored schema is really applied: a panel without a type and a bad tooltip mode fail."""
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator({**schema, "$ref": "#/definitions/Dashboard"})
    broken = json.loads(json.dumps(dashboard))
    del broken["panels"][0]["type"]
    broken["graphTooltip"] = 3
    assert len(list(validator.iter_errors(broken))) >= 2


def test_dashboard_uids_and_titles_are_unique_and_stable():
    dashboards = [load(p) for p in DASHBOARDS]
    uids = [d["uid"] for d in dashboards]
    assert len(set(uids)) == len(uids)
    assert all(re.fullmatch(r"[a-z0-9-]{8,40}", uid) for uid in uids), uids
    assert len({d["title"] for d in dashboards}) == len(dashboards)
    for d in dashboards:
        assert d.get("id") is None and "version" not in d and "__inputs" not in d, d["uid"]


def test_shared_crosshair_and_alert_annotations(dashboard):
    assert dashboard["graphTooltip"] == 1
    alerts = [a for a in dashboard["annotations"]["list"] if "ALERTS" in a.get("expr", "")]
    assert alerts and all(re.search(r'ALERTS\{alertstate="firing"', a["expr"]) for a in alerts)
    for annotation in alerts:  # ALERTS carries labels only: {{summary}} would always be empty
        used = set(re.findall(r"\{\{(\w+)\}\}", annotation["titleFormat"] + annotation["textFormat"]))
        assert used and used <= {"alertname", "severity", "job", "run", "rank", "instance", "gpu", "uuid"}, used
    # The annotations' text points at the alert list, which shows summary, description and runbook link.
    lists = [p for p in panels(dashboard) if p["type"] == "alertlist"]
    assert lists and all(p["title"] in a["textFormat"] for a in alerts for p in lists[:1])


# What each dashboard must show, by the metrics its queries use.
REQUIRED_METRICS = {
    "training-run": {
        "training_loss", "training_loss_max", "training_learning_rate", "training_grad_norm",
        "training_grad_norm_max", "training_steps_total", "training_samples_total",
        "training_data_wait_seconds_total", "training_nonfinite_steps_total", "training_last_nonfinite_step",
        "training_run_state", "training_run_info", "training_gpu_info", "nvml_gpu_busy_seconds_total",
        "nvml_gpu_idle_seconds_total", "nvml_gpu_power_usage_watts", "nvml_gpu_power_limit_watts",
        "nvml_gpu_memory_used_bytes", "nvml_gpu_memory_total_bytes",
        "instance_gpu:nvml_gpu_memory_used_bytes:predict_linear1h_4h", "nvml_gpu_temperature_celsius",
        "nvml_gpu_throttle_seconds_total", "ALERTS",
        # compare runs, the memory-leak view, the heartbeat, step time, scaler, custom keys, many ranks
        "training_start_timestamp_seconds", "training_logged_value_sum", "training_logged_value_count",
        "training_cuda_memory_allocated_bytes", "training_cuda_memory_reserved_bytes",
        "training_cuda_alloc_retries_total", "training_cuda_ooms_total", "nvml_gpu_sm_active_ratio",
        "nvml_gpu_tensor_active_ratio", "nvml_gpu_dram_active_ratio", "training_step_duration_seconds_bucket",
        "training_tokens_total", "training_loss_scale", "training_skipped_steps_total",
        "job_run:training_steps:rate5m_min", "job_run:training_steps:rate5m_median",
        "job_run:training_steps:rate5m_max", "training_process_info", "nvml_gpu_process_memory_used_bytes",
        "training_first_nonfinite_step", "training_grad_norm_max_step", "training_last_push_timestamp_seconds",
        "nvml_gpu_process_sm_utilization_ratio"},
    "gpu-fleet": {
        "nvml_gpu_utilization_ratio", "nvml_gpu_memory_used_bytes", "nvml_gpu_power_usage_watts",
        "nvml_gpu_temperature_celsius", "nvml_gpu_clock_hertz", "nvml_gpu_throttle_active",
        "nvml_gpu_pcie_throughput_bytes_per_second", "nvml_gpu_nvlink_data_bytes_total",
        "nvml_gpu_ecc_errors_total", "nvml_gpu_xid_errors_total", "nvml_gpu_process_memory_used_bytes",
        "nvml_up", "nvml_exporter_snapshot_age_seconds", "nvml_exporter_errors_total", "nvml_gpu_lost",
        "nvml_gpu_busy_seconds_total", "nvml_gpu_idle_seconds_total", "nvml_gpu_sm_active_ratio",
        "nvml_gpu_tensor_active_ratio", "nvml_gpu_dram_active_ratio", "ALERTS",
        "nvml_gpu_process_sm_utilization_ratio"},
}


@pytest.mark.parametrize("stem", sorted(REQUIRED_METRICS))
def test_dashboard_shows_what_the_issue_asks_for(stem):
    dashboard = load(REPO / "dashboards" / f"{stem}.json")
    used = {name for _, expr, _ in queries(dashboard) for name in metric_names(expr)}
    assert REQUIRED_METRICS[stem] - used == set()


def test_training_run_shows_the_tracks_side_by_side():
    """Model panels in the left half, Infra panels in the right half, paired row by row."""
    dashboard = load(REPO / "dashboards" / "training-run.json")
    rows: dict[int, dict[str, int]] = {}
    for panel in panels(dashboard):
        track = panel["title"].split(" · ")[0]
        if track in ("Model", "Infra"):
            pos = panel["gridPos"]
            assert (pos["x"], pos["w"]) == ((0, 12) if track == "Model" else (12, 12)), panel["title"]
            rows.setdefault(pos["y"], {})[track] = pos["h"]
    assert len(rows) >= 6
    assert all(set(row) == {"Model", "Infra"} and len(set(row.values())) == 1 for row in rows.values()), rows
    tracks = {panel["title"].split(" · ")[0] for panel in panels(dashboard) if " · " in panel["title"]}
    assert tracks == {"Model", "Infra"}
    infra = [t["expr"] for p in panels(dashboard) if p["title"].startswith("Infra · ") for t in p["targets"]]
    follows = [e for e in infra if e.endswith((f"* on (uuid) group_left (run, rank) {RUN_GPUS}",
                                               f"* on (uuid, gpu_instance) group_left (run, rank) {RUN_MIG_GPUS}"))]
    assert len(follows) >= len(infra) - 1, "Infra panels follow the run's GPUs while the run is live on them"
    mig = [e for e in infra if e.endswith(RUN_MIG_GPUS)]
    assert {"instance_gpu_mig:nvml_gpu_mig_busy:avg5m", "nvml_gpu_mig_sm_active_ratio",
            "nvml_gpu_mig_memory_used_bytes"} <= {name for e in mig for name in metric_names(e)}, \
        "a MIG run's Infra track shows its GPU instance"


def test_panel_ids_unique_and_grid_positions_do_not_overlap(dashboard):
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_variable_used_is_declared(dashboard):
    declared = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_VARIABLES
    text = json.dumps([dashboard["panels"], dashboard["annotations"], dashboard["templating"]])
    assert variable_names(text) - declared == set()


def test_every_datasource_is_the_provisioned_prometheus(dashboard):
    uids = {ds["uid"] for ds in provisioned("datasources", "datasources")}
    refs = [p["datasource"] for p in panels(dashboard) if "datasource" in p]
    refs += [t["datasource"] for p in panels(dashboard) for t in p.get("targets", [])]
    refs += [v["datasource"] for v in dashboard["templating"]["list"] if "datasource" in v]
    refs += [a["datasource"] for a in dashboard["annotations"]["list"] if not a.get("builtIn")]
    assert refs
    for ref in refs:
        assert ref == DATASOURCE, ref
    # The variable lists the Prometheus datasources and defaults to Grafana's default one: the
    # provisioned `dualtrack-prometheus` (isDefault) here, whatever a foreign Grafana has elsewhere.
    variable = dashboard["templating"]["list"][0]
    assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
    assert "current" not in variable and DATASOURCE_UID in uids
    assert "${DS_" not in json.dumps(dashboard) and DATASOURCE_UID not in json.dumps(dashboard)


def test_every_panel_has_a_unit_and_a_description(dashboard):
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel.get("description"), panel["title"]
        if not panel.get("targets"):  # the alert list: no query, no unit
            continue
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit in UNITS or (unit or "").startswith("suffix:"), f"{panel['title']}: unit {unit!r}"
        assert panel.get("description"), panel["title"]


UNIT_BY_SUFFIX = {"_ratio": "percentunit", "_bytes": "bytes", "_watts": "watt", "_celsius": "celsius",
                  "_hertz": "hertz", "_seconds_total": "percentunit"}  # rate of seconds: a time share


def expected_unit(expr: str) -> str | None:
    """The unit a query's result has, where its metric names tell (None: they do not)."""
    if "_count" in expr:  # a mean from a sum and a count: the unit of what was summed
        return None
    if " / " in expr:  # otherwise the dashboards only divide like quantities
        return "percentunit"
    suffixes = {s for name in metric_names(expr) for s in UNIT_BY_SUFFIX if name.endswith(s)}
    if len(suffixes) == 1 and not re.search(r"\bcount\(", expr):
        return UNIT_BY_SUFFIX[suffixes.pop()]
    return None


def test_units_match_what_the_query_measures(dashboard):
    """Ratios show as percent, bytes as bytes, watts as watts: a unit/metric mix-up is visible here."""
    checked = 0
    for panel in panels(dashboard):
        if panel["type"] not in ("timeseries", "stat"):
            continue
        units = {expected_unit(target["expr"]) for target in panel["targets"]}
        if len(units) == 1 and None not in units:
            assert panel["fieldConfig"]["defaults"]["unit"] == units.pop(), panel["title"]
            checked += 1
    assert checked >= 5


def test_every_metric_is_exported_by_the_exporter_or_the_hook(dashboard):
    known = EXPORTER_METRICS | HOOK_METRICS | PROMETHEUS_METRICS | recording_rule_names()
    for where, expr, _ in queries(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        assert names <= known, f"{where}: unknown metrics {sorted(names - known)}"
    for variable in query_variables(dashboard):
        selector, _ = label_values_args(variable["query"])
        assert metric_names(selector) <= known, variable["name"]


def test_metric_name_parser():
    assert metric_names('sum by (instance, gpu) (rate(nvml_gpu_busy_seconds_total{gpu=~"$gpu"}[5m]))'
                        ' / on(uuid) group_left() training_gpu_info{run="a and b"}') == {
        "nvml_gpu_busy_seconds_total", "training_gpu_info"}
    assert metric_names("predict_linear(x[15m], 7200) > bool 0 or vector(0)") == {"x"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/setup)")
def test_every_query_is_valid_promql(tmp_path):
    """promtool parses each query (variables substituted) as a recording rule expression."""
    rules = []
    for path in DASHBOARDS:
        dashboard = load(path)
        values = {v["name"]: ".*" for v in dashboard["templating"]["list"]} | {"hparam": "learning_rate"}
        for where, expr, _ in queries(dashboard):
            rules.append({"record": f"dashboard:query{len(rules)}:check", "expr": substitute(expr, values),
                          "labels": {"where": f"{path.stem}: {where}"}})
    (tmp_path / "queries.yml").write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(tmp_path / "queries.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_datasources_provisioning():
    datasources = provisioned("datasources", "datasources")
    uids = [ds["uid"] for ds in datasources]
    assert len(uids) == len(set(uids))
    by_type = {ds["type"]: ds for ds in datasources}
    assert by_type["prometheus"]["uid"] == DATASOURCE_UID
    assert by_type["prometheus"]["url"] == "https://prometheus:9090"
    assert by_type["alertmanager"]["url"] == "https://alertmanager:9093"
    assert by_type["alertmanager"]["jsonData"]["implementation"] == "prometheus"
    assert sum(bool(ds.get("isDefault")) for ds in datasources) == 1
    scrape = yaml.safe_load((REPO / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert by_type["prometheus"]["jsonData"]["timeInterval"] == scrape


def test_provisioning_matches_the_compose_mounts():
    mounts = {target: source for source, target in bind_mounts(services()["grafana"])}
    assert mounts.get("/etc/grafana/provisioning") == "./grafana/provisioning"
    providers = provisioned("dashboards", "providers")
    assert providers
    for provider in providers:
        assert provider["type"] == "file"
        assert mounts[provider["options"]["path"]] == "./dashboards"


def training_run() -> dict:
    return load(REPO / "dashboards" / "training-run.json")


def test_runs_compare_against_the_step_and_the_time_since_their_start():
    """XY charts, one line per run: loss, grad norm, learning rate, throughput against the step, and the
    loss against the seconds since each run's start."""
    charts = {p["title"]: p for p in panels(training_run()) if p["type"] == "xychart"}
    against = {title: p["options"]["dims"]["x"] for title, p in charts.items()}
    assert [t for t, x in against.items() if x == "step"] == [
        "Loss vs step", "Gradient norm vs step", "Learning rate vs step", "Throughput vs step"]
    assert against["Loss vs time since start"] == "seconds since start"
    for chart in charts.values():
        x_query = chart["targets"][0]["expr"]
        assert {"training_step", "training_start_timestamp_seconds"} & metric_names(x_query), x_query
        assert all(t["format"] == "table" and t["legendFormat"] == "{{run}}" for t in chart["targets"])
        assert chart["transformations"][-1] == {"id": "partitionByValues",
                                                "options": {"fields": ["run"], "keepFields": False}}


def test_run_table_covers_each_runs_own_life_whatever_the_range():
    table = next(p for p in panels(training_run()) if p["type"] == "table")
    exprs = [t["expr"] for t in table["targets"]]
    assert not any("$__range" in e or "$__rate_interval" in e for e in exprs)
    assert {w for e in exprs for w in re.findall(r"\[(\w+)\]", e)} == {"30d"}
    assert all("training_run_info" in e and t["instant"] for e, t in zip(exprs, table["targets"]))
    renamed = table["transformations"][1]["options"]["renameByName"].values()
    assert {"duration (h)", "steps", "final loss", "best loss", "samples/s"} <= set(renamed)


def test_runs_filter_by_any_hyper_parameter():
    """Hyper-parameter (any label of training_run_info) → its values → the runs that have them."""
    variables = {v["name"]: v for v in training_run()["templating"]["list"]}
    assert variables["hparam"]["query"] == 'label_names(training_run_info{job=~"$job"})'
    assert re.fullmatch(variables["hparam"]["regex"].strip("/"), "learning_rate")
    assert not any(re.fullmatch(variables["hparam"]["regex"].strip("/"), label)
                   for label in ("job", "run", "rank", "instance", "__name__"))
    assert variables["hvalue"]["query"] == 'label_values(training_run_info{job=~"$job"}, $hparam)'
    assert '$hparam=~"$hvalue"' in variables["run"]["query"] and variables["run"]["multi"]


def test_one_repeated_panel_per_custom_key():
    variables = {v["name"]: v for v in training_run()["templating"]["list"]}
    standard = re.compile(variables["key"]["regex"].strip("/"))
    assert standard.fullmatch("r2") and not standard.fullmatch("loss") and not standard.fullmatch("grad_norm")
    repeated = [p for p in panels(training_run()) if p.get("repeat")]
    assert [(p["repeat"], p["title"]) for p in repeated] == [("key", "$key"), ("run", "Run $run")]


def test_one_collapsed_row_per_selected_run_with_the_three_questions():
    row = next(p for p in panels(training_run()) if p.get("repeat") == "run")
    assert row["type"] == "row" and row["collapsed"]
    used = {name for panel in row["panels"] for t in panel["targets"] for name in metric_names(t["expr"])}
    assert {"training_data_wait_seconds_total", "nvml_gpu_idle_seconds_total", "training_grad_norm_max",
            "nvml_gpu_memory_used_bytes"} <= used


def test_legends_name_run_rank_host_and_gpu():
    for panel in panels(training_run()):
        for target in panel.get("targets", []):
            legend = target.get("legendFormat", "")
            if panel["title"].startswith("Model · "):
                assert {"{{run}}", "{{rank}}", "{{instance}}"} <= set(re.findall(r"\{\{\w+\}\}", legend)), legend
            if panel["title"].startswith("Infra · "):
                assert {"{{run}}", "{{instance}}", "{{gpu}}"} <= set(re.findall(r"\{\{\w+\}\}", legend)), legend
