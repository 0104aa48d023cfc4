"""The provisioned Grafana dashboards read as data: their panels, queries and variables, the metric
names a query reads, and the metrics the exporter, the hook and Prometheus provide."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import yaml

from stack.processes import RULES_DIR
from tests.support.paths import REPO

DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))

# The metric contract (the brief's list, plus what the exporter adds): what the exporter and hook export.
EXPORTER_METRICS = {
    "nvml_up", "nvml_driver_info", "nvml_gpu_info", "nvml_exporter_build_info",
    "nvml_gpu_utilization_ratio", "nvml_gpu_memory_controller_utilization_ratio",
    "nvml_gpu_busy_seconds_total", "nvml_gpu_idle_seconds_total", "nvml_gpu_memory_used_bytes",
    "nvml_gpu_memory_total_bytes", "nvml_gpu_memory_free_bytes", "nvml_gpu_temperature_celsius",
    "nvml_gpu_power_usage_watts", "nvml_gpu_power_limit_watts", "nvml_gpu_energy_joules_total",
    "nvml_gpu_clock_hertz", "nvml_gpu_clock_max_hertz", "nvml_gpu_performance_state",
    "nvml_gpu_fan_speed_ratio", "nvml_gpu_pcie_throughput_bytes_per_second",
    "nvml_gpu_nvlink_data_bytes_total", "nvml_gpu_throttle_active", "nvml_gpu_throttle_seconds_total",
    "nvml_gpu_ecc_errors_total", "nvml_gpu_retired_pages_total", "nvml_gpu_remapped_rows_total",
    "nvml_gpu_xid_errors_total", "nvml_gpu_process_memory_used_bytes", "nvml_gpu_process_sm_utilization_ratio",
    "nvml_gpu_sm_active_ratio", "nvml_gpu_tensor_active_ratio", "nvml_gpu_dram_active_ratio", "nvml_gpu_lost",
    "nvml_exporter_collector_success", "nvml_exporter_collector_duration_seconds",
    "nvml_exporter_errors_total", "nvml_exporter_snapshot_age_seconds", "nvml_exporter_gpu_lost_total",
    "nvml_gpu_memory_temperature_celsius",  # added by the exporter (docs/metrics.md)
    "nvml_gpu_mig_info", "nvml_gpu_mig_memory_used_bytes", "nvml_gpu_mig_memory_total_bytes",
    "nvml_gpu_mig_utilization_ratio", "nvml_gpu_mig_sm_active_ratio", "nvml_gpu_mig_tensor_active_ratio",
    "nvml_gpu_mig_dram_active_ratio",  # MIG GPU instances (docs/metrics.md)
}
HOOK_METRICS = {
    "training_step", "training_epoch", "training_loss", "training_loss_max", "training_learning_rate",
    "training_grad_norm", "training_grad_norm_max", "training_steps_total", "training_samples_total",
    "training_tokens_total", "training_step_duration_seconds_bucket",
    "training_step_duration_seconds_sum", "training_step_duration_seconds_count",
    "training_data_wait_seconds_total", "training_nonfinite_steps_total",
    "training_last_nonfinite_step", "training_last_nonfinite_batch_id",
    "training_cuda_memory_allocated_bytes", "training_cuda_memory_reserved_bytes",
    "training_cuda_alloc_retries_total", "training_cuda_ooms_total", "training_run_info",
    "training_gpu_info", "training_dropped_values_total", "training_push_failures_total",
    "training_last_update_timestamp_seconds", "training_run_state", "training_start_timestamp_seconds",
    # Shared names of the run-level work (the contract); pushed once that work is merged.
    "training_logged_value_sum", "training_logged_value_count", "training_first_nonfinite_step",
    "training_grad_norm_max_step", "training_loss_scale", "training_skipped_steps_total",
    "training_process_info", "training_world_size", "training_last_push_timestamp_seconds",
    "training_replica_divergent_steps_total",
}
# From Prometheus itself (scrape health, alert state).
PROMETHEUS_METRICS = {"up", "ALERTS"}
# Concrete values for Grafana's own variables when a query is run outside Grafana.
BUILTIN_VALUES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
PROMQL_FUNCTIONS_AND_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
    "bool", "inf", "nan",
}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, including those nested in rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict) -> Iterator[tuple[str, str, dict]]:
    """(where, expr, target) for every PromQL query: panel targets, then annotations."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel.get("title", f"panel {panel.get('id')}"), target["expr"], target
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield f"annotation {annotation['name']}", annotation["expr"], annotation


def variable_names(text: str) -> set[str]:
    """Template variables referenced as $name, ${name} or ${name:format}."""
    return {m.group(1) or m.group(2) for m in re.finditer(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))", text)}


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana variables in `expr` by concrete values (Grafana's own ones by defaults)."""
    merged = {**BUILTIN_VALUES, **values}
    return re.sub(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))",
                  lambda m: merged[m.group(1) or m.group(2)], expr)


def label_values_args(query: str) -> tuple[str, str | None]:
    """(series selector, label) of a `label_values(selector, label)` variable query; (selector, None)
    for `label_names(selector)` (the variable lists label names)."""
    match = re.fullmatch(r"label_values\((.+),\s*(\$?\w+)\)", query) or re.fullmatch(r"label_names\((.+)\)()", query)
    assert match, f"variable query {query!r} is not label_values(selector, label) or label_names(selector)"
    return match.group(1), match.group(2) or None


def query_variables(dashboard: dict) -> list[dict]:
    """The template variables that query Prometheus (not the datasource picker)."""
    return [v for v in dashboard["templating"]["list"] if v["type"] == "query"]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (identifiers that are not functions, labels or keywords)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)\s*(\()?", text):
        name, call = match.groups()
        if not call and name.lower() not in PROMQL_FUNCTIONS_AND_KEYWORDS:
            names.add(name)
    return names


@lru_cache(maxsize=1)
def recording_rule_names() -> frozenset[str]:
    names = set()
    for path in RULES_DIR.glob("*.yml"):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            names.update(rule["record"] for rule in group.get("rules", []) if "record" in rule)
    return frozenset(names)
