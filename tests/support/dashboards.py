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
from tests.support.declarations import exporter_series, hook_series
from tests.support.paths import REPO

DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))

# What the exporter and the hook export, from their declarations (exporter.metrics, trainer_hook.contract).
EXPORTER_METRICS = frozenset(exporter_series())
HOOK_METRICS = frozenset(hook_series())
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
