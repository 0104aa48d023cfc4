"""One table of thresholds and scores (dualtrack/thresholds.py): `dualtrack explain` reads it, and
every number the rules share with explain (TrainingStragglerRank, TrainingDataLoaderBottleneck,
job_run_rank:training_infra_cause:score) and docs/explain.md's cause table are checked against it
here, so a copy that drifts fails."""
from __future__ import annotations

import math
import re

import yaml

from dualtrack import thresholds as limits
from tests.support.paths import REPO

INFRA_CAUSE = "job_run_rank:training_infra_cause:score"
#: The causes whose condition in the rules has a threshold other than "rose" (> 0).
RULE_THRESHOLDS = {"thermal_throttle": [limits.THROTTLE_SHARE], "power_throttle": [limits.THROTTLE_SHARE],
                   "hw_slowdown": [limits.THROTTLE_SHARE], "co_tenant": [limits.CO_TENANT_SM]}


def rules(name: str) -> dict[str, dict]:
    """rules/<name>.yml's rules by alert or record name."""
    groups = yaml.safe_load((REPO / "rules" / f"{name}.yml").read_text())["groups"]
    return {rule.get("alert") or rule["record"]: rule for group in groups for rule in group["rules"]}


def minutes(seconds: float) -> str:
    return f"{seconds / 60:g}m"


def infra_cause_drift(expr: str) -> list[str]:
    """How the rule's cause terms differ from the table: causes, scores, thresholds, windows."""
    pieces = re.split(r'"cause", "(\w+)", "", ""\)', expr)
    terms = dict(zip(pieces[1::2], pieces[0::2]))
    drift = [] if set(terms) == set(limits.RECORDED) else [f"causes {sorted(terms)} != {sorted(limits.RECORDED)}"]
    for kind, term in terms.items():
        top, lesser = limits.SCORES[kind]
        scores = sorted(float(x) for x in re.findall(r"\* 0 \+ ([\d.]+)", term))
        wanted = sorted([top, lesser]) if kind == "co_tenant" else [top]
        compared = sorted(float(x) for x in re.findall(r"> ([\d.]+)", term) if float(x) != 0)
        windows = {bracket or offset for bracket, offset in re.findall(r"\[(\w+)\]|offset (\w+)", term)}
        windows -= {minutes(limits.EVIDENCE_WINDOW)}  # gpu_lost's term (ALERTS) has none
        for what, found, expected in (("scores", scores, wanted),
                                      ("thresholds", compared, RULE_THRESHOLDS.get(kind, [])),
                                      ("windows other than the table's", windows, set())):
            if found != expected:
                drift.append(f"{kind} {what}: rule {found}, table {expected}")
    return drift


def test_the_rules_infra_causes_score_as_the_table():
    expr = rules("explain")[INFRA_CAUSE]["expr"]
    assert infra_cause_drift(expr) == []


def test_a_score_or_threshold_changed_in_the_rule_is_caught():
    """The check above can fail: each number of the rule, changed alone, is reported."""
    expr = rules("explain")[INFRA_CAUSE]["expr"]
    edits = {"* 0 + 0.6": "* 0 + 0.65", "* 0 + 0.7\n": "* 0 + 0.72\n", "> 0.05) * 0 + 0.75": "> 0.1) * 0 + 0.75",
             "[10m])) > 0.05) * 0 + 0.55": "[10m])) > 0.04) * 0 + 0.55",
             "[10m]) > 0) * 0 + 0.9": "[5m]) > 0) * 0 + 0.9"}
    for old, new in edits.items():
        assert expr.count(old) == 1, old
        assert len(infra_cause_drift(expr.replace(old, new))) == 1, new


def stragglers() -> dict[str, dict]:
    """TrainingStragglerRank's two rules by their basis: "step_rate" (ranks at their own pace) and
    "collective_wait" (synchronous data parallelism)."""
    groups = yaml.safe_load((REPO / "rules" / "distributed.yml").read_text())["groups"]
    return {rule["labels"].get("basis", "step_rate"): rule for group in groups for rule in group["rules"]
            if rule.get("alert") == "TrainingStragglerRank"}


def test_straggler_rule_is_the_tables():
    """TrainingStragglerRank's share, `for` and rate window are explain's straggler condition."""
    distributed = rules("distributed")
    straggler = stragglers()["step_rate"]
    assert [float(x) for x in re.findall(r"\) < ([\d.]+)", straggler["expr"])] == [limits.STRAGGLER_SHARE]
    assert straggler["for"] == minutes(limits.STRAGGLER_FOR)
    for expr in (straggler["expr"], distributed["job_run:training_steps:rate5m_median"]["expr"]):
        assert set(re.findall(r"\[(\w+)\]", expr)) == {minutes(limits.RATE_WINDOW)}, expr


def test_lockstep_straggler_rule_is_the_tables():
    """TrainingStragglerRank under synchronous data parallelism: its gap, `for` and rate window are
    explain's lockstep straggler condition."""
    straggler = stragglers()["collective_wait"]
    gaps = re.findall(r"ratio2m\n\s*\) >= ([\d.]+)", straggler["expr"])
    assert [float(x) for x in gaps] == [limits.STRAGGLER_WAIT_GAP]
    assert straggler["for"] == minutes(limits.STRAGGLER_WAIT_FOR)
    ratio = rules("distributed")["job_run_rank:training_collective_wait:ratio2m"]["expr"]
    assert set(re.findall(r"\[(\w+)\]", ratio)) == {minutes(limits.STRAGGLER_WAIT_WINDOW)}, ratio


def test_data_loader_rule_is_the_tables():
    """TrainingDataLoaderBottleneck's share and `for` are explain's data starvation."""
    loader = rules("alerts")["TrainingDataLoaderBottleneck"]
    shares = re.findall(r"job_run_rank:training_data_wait_seconds:rate5m > ([\d.]+)", loader["expr"])
    assert [float(x) for x in shares] == [limits.STARVATION_SHARE], loader["expr"]
    assert loader["for"] == minutes(limits.STARVATION_FOR)
    data_wait = rules("recording")["job_run_rank:training_data_wait_seconds:rate5m"]["expr"]
    assert f"[{minutes(limits.RATE_WINDOW)}]" in data_wait


def test_gradient_spike_and_loss_scale_rules_are_the_tables():
    """TrainingGradientExplosion's windows and numbers and TrainingLossScaleCollapse's window and factor
    are explain's (its expressions equal the rules': tests/dualtrack/test_explain.py), and docs/explain.md says them."""
    spike = rules("alerts")["TrainingGradientExplosion"]["expr"]
    window, baseline = minutes(limits.GRAD_SPIKE_WINDOW), minutes(limits.GRAD_SPIKE_BASELINE)
    assert set(re.findall(r"\[(\w+)\]", spike)) == {window, baseline}, spike
    assert set(re.findall(r"offset (\w+)", spike)) == {window}
    assert [float(x) for x in re.findall(r"> ([\d.]+) \* quantile_over_time\(([\d.]+),", spike)[0]] == [
        limits.GRAD_SPIKE_FACTOR, limits.GRAD_SPIKE_QUANTILE]
    assert [float(x) for x in re.findall(r"\) > ([\d.e-]+)\n", spike)] == [limits.GRAD_SPIKE_FLOOR]
    assert [int(x) for x in re.findall(r">= (\d+)", spike)] == [limits.GRAD_SPIKE_HISTORY]
    collapse = rules("alerts")["TrainingLossScaleCollapse"]["expr"].splitlines()[0]
    assert re.findall(r"training_loss_scale\[(\w+)\]", collapse) == [f"{limits.LOSS_SCALE_WINDOW / 3600:g}h"]
    assert [float(x) for x in re.findall(r"\] ?\) / (\d+)", collapse)] == [limits.LOSS_SCALE_COLLAPSE]
    events = (REPO / "docs" / "explain.md").read_text().split("## Events")[1].split("## Causes")[0]
    assert (f"the {limits.GRAD_SPIKE_WINDOW / 60:g}-min maximum of `training_grad_norm_max` above "
            f"{limits.GRAD_SPIKE_FACTOR:g}x its median over the {limits.GRAD_SPIKE_BASELINE / 60:g} min before, above "
            f"1e-{-math.log10(limits.GRAD_SPIKE_FLOOR):g}, with {limits.GRAD_SPIKE_HISTORY} samples") in events
    assert f"below 1/{limits.LOSS_SCALE_COLLAPSE:g} of its maximum over the last hour" in events
    assert limits.LOSS_SCALE_WINDOW == 3600


def test_the_docs_cause_table_is_the_tables():
    """docs/explain.md: each cause's scores, and the percentages of its evidence, are the table's."""
    text = (REPO / "docs" / "explain.md").read_text()
    table = text.split("## Causes")[1].split("\n\n")[2]
    evidence = {"thermal_throttle": limits.THROTTLE_SHARE, "clock_drop": limits.CLOCK_DROP,
                "memory_pressure": limits.MEMORY_FULL, "co_tenant": limits.CO_TENANT_SM,
                "data_wait": limits.DATA_WAIT_SHARE}
    seen = set()
    for row in table.splitlines()[2:]:
        kinds_cell, evidence_cell, score_cell, _ = [cell.strip() for cell in row.strip("|").split(" | ")]
        kinds = re.findall(r"`(\w+)`", kinds_cell)
        seen.update(kinds)
        scores = {float(x) for x in re.findall(r"\d+\.\d+", score_cell)}
        if kinds == ["data_wait"]:
            assert scores == {limits.DATA_WAIT_BONUS, limits.DATA_WAIT_MAX}, row
        else:
            assert scores == {s for kind in kinds for s in limits.SCORES[kind] if s is not None}, row
        shares = {round(int(x) / 100, 2) for x in re.findall(r"(\d+) %", evidence_cell)}
        assert shares == {evidence[kind] for kind in kinds if kind in evidence}, row
    assert seen == set(limits.SCORES) | {"data_wait"}
    recorded = text.split("## In alert notifications")[1].split("\n\n")[1]
    assert {float(x) for x in re.findall(r"\d+\.\d+", recorded)} == {
        s for kind in limits.RECORDED for s in ([limits.score(kind)] if kind != "co_tenant" else limits.SCORES[kind])}
    assert {round(int(x) / 100, 2) for x in re.findall(r"(\d+) %", recorded)} == {limits.THROTTLE_SHARE}
    events = text.split("## Events")[1].split("## Causes")[0]
    assert (f"{limits.REGRESSION_RATIO * 100 - 100:.0f} % longer than its median of the "
            f"{limits.REGRESSION_BASELINE / 60:.0f} min before, for {limits.REGRESSION_FOR / 60:.0f} min") in events
    assert (f"below {limits.STRAGGLER_SHARE:.0%} of the run's median step rate for "
            f"{limits.STRAGGLER_FOR / 60:.0f} min").replace("%", " %") in events
    assert (f"{limits.STRAGGLER_WAIT_GAP:.0%} or more below the run's largest for "
            f"{limits.STRAGGLER_WAIT_FOR / 60:.0f} min, rates over "
            f"{limits.STRAGGLER_WAIT_WINDOW / 60:.0f} min").replace("%", " %") in events


def test_the_pause_bound_is_the_tables_in_the_rules_and_the_docs():
    """PAUSE_MAX: how long a pause holds back the hang and stall alerts, and when TrainingPauseTooLong
    fires; docs/alerts.md states it in minutes."""
    bound = f"{limits.PAUSE_MAX:.0f}"
    held = f"unless on (job, run) job_run:training_pause:seconds <= {bound}"
    assert held in rules("distributed")["TrainingRankHung"]["expr"]
    assert held in rules("alerts")["TrainingStalled"]["expr"]
    assert f"training_pause_start_timestamp_seconds > {bound}\n" in rules("pause")["TrainingPauseTooLong"]["expr"]
    numbers = {int(x) for rule in rules("pause").values() for x in re.findall(r"(?<![\w.\[])(\d+)(?![\w.\]])",
                                                                                rule["expr"])}
    assert numbers <= {int(limits.PAUSE_MAX), 60, 1}, numbers  # the bound, the push staleness, "running"
    runbook = (REPO / "docs" / "alerts.md").read_text().split("## TrainingPauseTooLong")[1].split("\n## ")[0]
    assert f"{limits.PAUSE_MAX / 60:.0f} min" in runbook
