"""One XID catalogue (exporter/xids.py): the rules' selectors, explain's scores, the exporter's log
line and the docs all agree with it."""
from __future__ import annotations

import ast
import re

import pytest
import yaml

from dualtrack.explain.causes import Search, counter_causes
from dualtrack.explain.model import Event
from exporter import xids
from tests.support.paths import REPO

SELECTOR = re.compile(r'nvml_gpu_xid_errors_total\{[^{}]*?\bxid(=~|!~)"([^"]*)"[^{}]*\}')


def rules() -> dict[tuple[str, str, str], dict]:
    """Every rule of rules/*.yml by (file name, alert or record name, severity)."""
    found = {}
    for path in sorted((REPO / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule.get("record")
                found[(path.name, name, rule.get("labels", {}).get("severity", ""))] = rule
    return found


def test_the_catalogue_has_no_dependencies():
    imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(ast.parse((REPO / "exporter" / "xids.py").read_text()))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    assert imported <= {"__future__", "dataclasses"}


def test_the_xids_the_issue_names_are_catalogued_with_nvidias_meaning():
    assert {13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 74, 79, 92, 94, 95, 119, 120} <= set(xids.BY_CODE)
    assert xids.meaning(79) == "GPU has fallen off the bus" and xids.meaning(119) == "GSP RPC Timeout"
    assert xids.meaning(12345) == "see NVIDIA's XID catalog"
    assert not any(xids.BY_CODE[code].hardware for code in (13, 31, 43, 45))


def test_every_xid_selector_in_the_rules_is_the_catalogues():
    selectors = {key: SELECTOR.findall(rule["expr"]) for key, rule in rules().items() if "xid_errors" in rule["expr"]}
    hardware, disruptive = xids.regex(), xids.regex(disruptive=True)
    assert selectors.pop(("alerts.yml", "GPUXidError", "critical")) == [("=~", hardware)] * 2
    assert selectors.pop(("alerts.yml", "GPUXidError", "warning")) == [("!~", hardware)] * 2
    infra = selectors.pop(("explain.yml", "job_run_rank:training_infra_cause:score", ""))
    assert infra and set(infra) == {("=~", disruptive)}
    assert not {key: found for key, found in selectors.items() if found}, "an XID selector the catalogue does not cover"


@pytest.mark.parametrize("path", xids.GENERATED)
def test_the_catalogue_parts_are_what_the_generator_writes(path: str) -> None:
    text = (REPO / path).read_text()
    assert xids.regenerate(text) == text, f"{path} disagrees with exporter/xids.py: run python -m exporter.xids"


def test_the_generator_finds_every_part() -> None:
    alerts, docs = (REPO / "rules" / "alerts.yml").read_text(), (REPO / "docs" / "alerts.md").read_text()
    for severity, hardware in (("critical", True), ("warning", False)):
        description = rules()[("alerts.yml", "GPUXidError", severity)]["annotations"]["description"]
        assert xids.alert_marker(hardware) in description and alerts.count(xids.alert_marker(hardware)) == 1
        codes = re.findall(r'eq \$labels\.xid "(\d+)"', description)
        assert codes == [str(x.code) for x in xids.CATALOGUE if x.hardware == hardware]
    assert xids.alert_table() in docs and xids.markdown_table() in (REPO / "docs" / "metrics.md").read_text()


def test_explain_scores_exactly_the_rules_causes_high():
    disruptive = set(xids.regex(disruptive=True).split("|"))
    event = Event("failed", 10, 1000.0, "0", "GPU-a", "")
    search = Search(event, 'run="r"', ["GPU-a"], "GPU-a", ["GPU-a"], [], {"GPU-a": "0"}, 900.0, 1015.0, 15.0)
    for xid in xids.CATALOGUE:
        series = {"metric": {"__name__": "nvml_gpu_xid_errors_total", "uuid": "GPU-a", "xid": str(xid.code)},
                  "values": [[900.0, "0"], [950.0, "1"]]}
        [cause] = counter_causes(search, [series], 15.0)
        assert (cause.score == 0.95) == (str(xid.code) in disruptive), xid
        assert f"XID {xid.code} ({xid.meaning})" in cause.evidence


def test_explains_doc_lists_the_disruptive_xids() -> None:
    explain = (REPO / "docs" / "explain.md").read_text()
    listed = re.search(r"hardware XIDs \(([\d,\s]+);", explain)
    assert listed
    disruptive = [int(code) for code in xids.regex(disruptive=True).split("|")]
    assert [int(code) for code in listed.group(1).split(",")] == disruptive
