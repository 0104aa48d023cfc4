"""`dualtrack explain`: backfilled runs in a real Prometheus, one per scenario (both tracks), and
the cause explain names for each; bad input gets one line."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from dualtrack import thresholds
from dualtrack.cli import main
from dualtrack.explain import events as explain_events
from dualtrack.explain.command import parse_time
from dualtrack.explain.model import Cause, Event, Timeline
from dualtrack.explain.render import render_text
from stack import processes
from tests.support import daemons
from tests.support import explain as support
from tests.support.explain import infra_cause_rule
from tests.support.paths import REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory) -> dict:
    """One Prometheus holding every scenario as its own run (named after the scenario)."""
    work = tmp_path_factory.mktemp("explain")
    base = (time.time() // 3600 - 3) * 3600
    # forged-xid: the xid scenario, its GPU series pushed or remote-written under the training job
    support.backfill({**{name: name for name in support.SCENARIOS}, "forged-xid": "xid"}, base,
                     work / "prometheus-data", work, gpu_jobs={"forged-xid": "train"})
    with support.serving(work) as url:
        yield {"url": url, "base": base}


def explain(prometheus: dict, run: str, capsys, *extra: str) -> tuple[int, str, str]:
    window = ["--since", str(prometheus["base"]), "--until", str(prometheus["base"] + 3700)]
    code = main(["explain", run, "--prometheus", prometheus["url"], *window, *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def timeline(prometheus: dict, run: str, capsys) -> dict:
    code, out, err = explain(prometheus, run, capsys, "--json")
    assert code == 0, err
    found = json.loads(out)
    assert found["run"] == run
    for event in found["events"]:
        assert {"kind", "step", "time", "rank", "gpu_uuid", "causes"} <= set(event)
        assert all({"kind", "evidence", "score"} <= set(c) for c in event["causes"])
    return found


def kinds(event: dict) -> list[str]:
    return [cause["kind"] for cause in event["causes"]]


def test_gpu_series_from_another_job_than_the_exporters_are_no_evidence(prometheus, capsys):
    """The xid scenario's XID 79 written under the training job (pushed, or remote-written, by whoever
    holds the hook's credentials) blames no GPU; the exporter's own does."""
    [nan] = [e for e in timeline(prometheus, "xid", capsys)["events"] if e["kind"] == "nonfinite"]
    assert kinds(nan)[0] == "xid"
    forged = [e for e in timeline(prometheus, "forged-xid", capsys)["events"] if e["kind"] == "nonfinite"]
    assert forged and all("xid" not in kinds(event) for event in forged)


def test_a_healthy_run_has_nothing_to_explain(prometheus, capsys):
    assert timeline(prometheus, "healthy", capsys)["events"] == []
    code, out, _ = explain(prometheus, "healthy", capsys)
    assert code == 0 and "nothing to explain" in out


def test_nan_after_xid_79_on_one_rank_blames_the_gpu(prometheus, capsys):
    events = timeline(prometheus, "xid", capsys)["events"]
    nonfinite = [e for e in events if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1
    event = nonfinite[0]
    assert event["rank"] == "1" and event["gpu_uuid"] == support.uuid_of("xid", 1)
    assert event["time"] == prometheus["base"] + support.FAULT_AT + support.XID_LEAD
    assert kinds(event) == ["xid"] and "XID 79 (GPU has fallen off the bus)" in event["causes"][0]["evidence"]
    assert ("45 s after XID 79 (GPU has fallen off the bus) on that GPU; no other rank affected: hardware, "
            "not the model") in event["sentence"]
    failed = [e for e in events if e["kind"] == "failed"]
    assert [e["rank"] for e in failed] == ["1"] and kinds(failed[0]) == ["xid"]
    assert {e["kind"] for e in events} == {"nonfinite", "failed"}  # the failed rank is no slowdown


def test_nan_on_a_mig_instance_after_xid_79_on_its_parent_gpu(prometheus, capsys):
    found = timeline(prometheus, "mig", capsys)
    mig, parent = support.hook_uuid_of("mig", "mig", 1, 2), support.uuid_of("mig", 1)
    assert mig.startswith("MIG-") and found["gpus"]["1"] == mig and found["parent_gpus"] == {"1": parent}
    (event,) = [e for e in found["events"] if e["kind"] == "nonfinite"]
    assert event["rank"] == "1" and event["gpu_uuid"] == mig
    assert kinds(event) == ["xid"]
    assert f"XID 79 (GPU has fallen off the bus) on {parent}" in event["causes"][0]["evidence"]
    assert (f"45 s after XID 79 (GPU has fallen off the bus) on its MIG instance's parent GPU ({parent}); "
            "no other rank affected: hardware, not the model") in event["sentence"]
    code, out, _ = explain(prometheus, "mig", capsys)
    assert code == 0 and f"rank 1 {mig} (on {parent})" in out.splitlines()[0]


def test_an_oom_on_a_mig_instance_reads_the_instance_memory(prometheus, capsys):
    events = timeline(prometheus, "mig-oom", capsys)["events"]
    (oom,) = [e for e in events if e["kind"] == "oom"]
    parent = support.uuid_of("mig-oom", 1)
    assert oom["rank"] == "1" and kinds(oom) == ["memory_pressure"] and oom["causes"][0]["score"] == 0.8
    assert oom["causes"][0]["evidence"] == f"{parent} GPU instance 1 memory 99% full"
    assert (f"with 99% of the memory of GPU instance 1 used on its MIG instance's parent GPU ({parent})"
            in oom["sentence"])
    # The server in the parent's other GPU instance is isolated from rank 1's: no co-tenant.
    assert "co_tenant" not in {kind for event in events for kind in kinds(event)}


def test_a_lost_gpu_is_the_first_cause(prometheus, capsys):
    (event,) = timeline(prometheus, "gpu-lost", capsys)["events"]
    assert event["kind"] == "failed" and event["rank"] == "1"
    assert kinds(event) == ["gpu_lost", "xid"] and event["causes"][0]["score"] == 0.99
    assert f"{support.uuid_of('gpu-lost', 1)} lost (stopped answering NVML)" in event["causes"][0]["evidence"]
    assert event["sentence"].endswith(
        f"failed on rank 1 ({support.uuid_of('gpu-lost', 1)}) 30 s after a GPU loss on that GPU (it stopped answering "
        "NVML): hardware, not the model")


def test_nan_on_every_rank_with_healthy_gpus_finds_no_cause(prometheus, capsys):
    (event,) = timeline(prometheus, "nan-all", capsys)["events"]
    assert event["kind"] == "nonfinite" and event["rank"] == "0"
    assert kinds(event) == ["none_found"] and event["causes"][0]["score"] == 0
    assert "all 2 ranks affected: no GPU evidence, so the model or its input" in event["sentence"]


def test_a_corrupted_replica_is_an_event_with_its_gpus_ecc_error(prometheus, capsys):
    """Rank 1's post-reduction grad norm differs from its peers' from FAULT_AT, 2 min after an
    uncorrected ECC error on its GPU: one replica_divergence event, blaming that error."""
    events = timeline(prometheus, "replica", capsys)["events"]
    (event,) = events
    assert (event["kind"], event["rank"]) == ("replica_divergence", "1")
    assert event["time"] == pytest.approx(prometheus["base"] + support.FAULT_AT, abs=support.SCRAPE)
    assert kinds(event) == ["ecc"]
    assert event["gpu_uuid"] == support.uuid_of("replica", 1)


def test_a_thermal_throttle_that_slows_the_steps(prometheus, capsys):
    (event,) = timeline(prometheus, "thermal", capsys)["events"]
    assert event["kind"] == "step_time_regression"
    assert event["causes"][0]["kind"] == "thermal_throttle"
    assert support.uuid_of("thermal", 1) in event["causes"][0]["evidence"]
    assert set(kinds(event)) <= {"thermal_throttle", "clock_drop"}
    assert event["time"] >= prometheus["base"] + support.FAULT_AT


@pytest.mark.parametrize("run, kind", [("thermal", "thermal_throttle"), ("power", "power_throttle")])
def test_explain_scores_a_throttle_as_the_rules_do(prometheus, capsys, run, kind):
    """The rules' throttle terms, evaluated on the same series after the slowdown, score rank 1's GPU as
    explain scores the throttle it names (one table: dualtrack/thresholds.py). In "power" each of the two
    power reasons holds the clocks 4.5 % of the time: together 9 %, above the 5 % of both."""
    (event,) = timeline(prometheus, run, capsys)["events"]
    scored = {(s["metric"]["rank"], s["metric"]["cause"]): float(s["value"][1])
              for s in daemons.query(prometheus["url"], infra_cause_rule(), at=event["time"] + 60)
              if s["metric"]["run"] == run}
    assert scored == {("1", kind): thresholds.score(kind)}
    assert event["kind"] == "step_time_regression" and kinds(event)[0] == kind, event["causes"]
    assert event["causes"][0]["score"] == thresholds.score(kind)


def test_a_co_tenant_process_makes_one_rank_a_straggler(prometheus, capsys):
    """The neighbour that computes on rank 1's GPU is named with how much it computed, above the idle
    one that only holds memory on rank 0's GPU (named for the run-wide slowdown, not the straggler)."""
    events = timeline(prometheus, "co-tenant", capsys)["events"]
    (straggler,) = [e for e in events if e["kind"] == "straggler"]
    assert straggler["rank"] == "1" and kinds(straggler) == ["co_tenant"]
    (cause,) = straggler["causes"]
    assert cause["evidence"] == (f"process stress-ng (pid 4242) of no run on {support.uuid_of('co-tenant', 1)}, "
                                 "12.0 GiB, 40% SM")
    assert cause["score"] == thresholds.score("co_tenant")
    assert "with another process (stress-ng, pid 4242, computing 40% of the SMs) on that GPU" in straggler["sentence"]
    (slowdown,) = [e for e in events if e["kind"] == "step_time_regression"]
    assert [(c["score"], c["evidence"]) for c in slowdown["causes"]] == [
        (0.75, f"process stress-ng (pid 4242) of no run on {support.uuid_of('co-tenant', 1)}, 12.0 GiB, 40% SM"),
        (0.7, f"process jupyter (pid 5151) of no run on {support.uuid_of('co-tenant', 0)}, 2.0 GiB, 0% SM")]
    assert {e["kind"] for e in events} == {"straggler", "step_time_regression"}


def test_a_throttled_gpu_under_ddp_makes_its_rank_the_straggler(prometheus, capsys):
    """Synchronous training (DDP, collectives timed): rank 1's GPU throttles, every rank's step slows
    alike, and the ranks' step rates stay equal; rank 1 is the one the others wait for in the
    all-reduce, named a straggler within 10 min with its GPU's thermal throttle."""
    events = timeline(prometheus, "ddp-thermal", capsys)["events"]
    (straggler,) = [e for e in events if e["kind"] == "straggler"]
    assert straggler["rank"] == "1" and kinds(straggler)[0] == "thermal_throttle", straggler["causes"]
    assert prometheus["base"] + support.FAULT_AT < straggler["time"] < prometheus["base"] + support.FAULT_AT + 600
    assert "the other ranks waited for it in the collectives (38% of each step) on rank 1" in straggler["sentence"]
    assert straggler["sentence"].endswith(": hardware, not the model"), straggler["sentence"]
    assert {e["kind"] for e in events} == {"straggler", "step_time_regression"}


def test_a_co_tenant_that_slows_every_rank_by_a_fifth_is_a_regression(prometheus, capsys):
    """A neighbour on rank 1's GPU makes every rank's (synchronous) step 22-27 % longer: a sustained
    slowdown of 20 % or more, explained by the co-tenant; no rank is a straggler."""
    (event,) = timeline(prometheus, "co-tenant-sync", capsys)["events"]
    assert event["kind"] == "step_time_regression" and event["rank"] is None
    assert prometheus["base"] + support.FAULT_AT < event["time"] < prometheus["base"] + support.FAULT_AT + 600
    assert re.search(r"step time rose from 0\.5 s to 0\.6\d* s \(x1\.2\d\)", event["sentence"]), event["sentence"]
    assert kinds(event) == ["co_tenant"] and event["causes"][0]["score"] == thresholds.score("co_tenant")
    assert event["sentence"].endswith(
        f"with another process (stress-ng, pid 4242, computing 40% of the SMs) on rank 1's "
        f"GPU ({support.uuid_of('co-tenant-sync', 1)}): another process on the GPU, not the model")


def test_explain_scores_co_tenants_as_the_rules_do(prometheus, capsys):
    """The rules' co_tenant term (rules/explain.yml), evaluated on the same series at the straggler's
    evidence time, scores each rank's GPU as explain scores its co-tenant."""
    events = timeline(prometheus, "co-tenant", capsys)["events"]
    (slowdown,) = [e for e in events if e["kind"] == "step_time_regression"]
    by_gpu = {support.uuid_of("co-tenant", rank): str(rank) for rank in range(2)}
    explained = {by_gpu[c["evidence"].split(" on ")[1].split(",")[0]]: c["score"] for c in slowdown["causes"]}
    scored = {s["metric"]["rank"]: float(s["value"][1])
              for s in daemons.query(prometheus["url"], infra_cause_rule(), at=slowdown["time"] + 60)
              if s["metric"]["run"] == "co-tenant" and s["metric"]["cause"] == "co_tenant"}
    assert scored == explained == {"0": 0.7, "1": 0.75}


def test_a_starving_data_loader(prometheus, capsys):
    events = timeline(prometheus, "starving", capsys)["events"]
    assert {e["kind"] for e in events} == {"data_starvation", "step_time_regression"}
    for event in events:
        assert kinds(event) == ["data_wait"], event
        assert "the input pipeline" in event["sentence"]


def test_a_fine_tunes_spike_that_fires_the_alert_is_a_gradient_spike_event(prometheus, capsys):
    """Norms around 5e-5 and one push 20x above: TrainingGradientExplosion fires (its condition needs the
    spike, not the median, above 1e-4), so explain names the spike too."""
    events = timeline(prometheus, "fine-tune-spike", capsys)["events"]
    assert [(e["kind"], e["rank"], e["time"]) for e in events] == [
        ("grad_spike", "0", prometheus["base"] + support.FAULT_AT)], events


def promql_text(expr: str) -> str:
    """`expr` with explain's matchers left out, its spaces and the spelling of its numbers (1e-4, 0.0001) one."""
    words = " ".join(expr.replace("{SEL}", "").split())
    return re.sub(r"(?<![\w.])\d+(\.\d+)?(e-?\d+)?(?![\w.])", lambda number: repr(float(number[0])), words)


def alert_rules() -> dict[str, dict]:
    return {rule["alert"]: rule for group in yaml.safe_load((REPO / "rules" / "alerts.yml").read_text())["groups"]
            for rule in group["rules"] if "alert" in rule}


def test_explain_uses_the_alerts_own_conditions():
    """One definition: explain's gradient spike is TrainingGradientExplosion's expression, its loss-scale
    collapse TrainingLossScaleCollapse's first condition (their numbers, and those of data starvation and
    stragglers, are dualtrack/thresholds.py's: tests/dualtrack/test_thresholds.py)."""
    rules = alert_rules()
    gating = "and on (job, run, rank, instance) training_run_state{state=\"running\"} == 1"
    explosion = " ".join(rules["TrainingGradientExplosion"]["expr"].split())
    assert explosion.endswith(gating)
    assert promql_text(explosion[:-len(gating)]) == promql_text(explain_events.GRAD_SPIKE)
    collapse = rules["TrainingLossScaleCollapse"]["expr"].splitlines()[0]
    assert promql_text(collapse) == promql_text(explain_events.LOSS_SCALE_COLLAPSE)


def test_the_alert_comparison_can_fail():
    """A window or a number of the rule changed alone is a different expression."""
    spike = promql_text(" ".join(alert_rules()["TrainingGradientExplosion"]["expr"].split()))
    for old, new in (("[30m]", "[20m]"), ("> 1e-4", "> 1e-3"), (">= 5", ">= 4"), ("10 *", "8 *")):
        assert promql_text(spike.replace(promql_text(old), promql_text(new))) != spike, old
    collapse = alert_rules()["TrainingLossScaleCollapse"]["expr"].splitlines()[0]
    assert promql_text(collapse.replace("[1h]", "[2h]")) != promql_text(explain_events.LOSS_SCALE_COLLAPSE)


def test_a_learning_rate_jump_is_named_before_the_spike_and_the_nonfinite_step_it_causes(prometheus, capsys):
    """The demo's explosion: the learning rate jumps 0.03 -> 300, the gradient norm spikes at a step and the
    next step is non-finite, in one push. The spike comes first, at its step's own time, and the jump is the
    top cause of both, with its values."""
    base = prometheus["base"] + support.FAULT_AT
    events = timeline(prometheus, "lr-jump", capsys)["events"]
    assert [(e["kind"], e["rank"]) for e in events] == [("grad_spike", "0"), ("nonfinite", "0")], events
    spike, nonfinite = events
    assert spike["step"] + 1 == nonfinite["step"] and spike["other_ranks"] == nonfinite["other_ranks"] == ["1"]
    # Steps last 0.5 s: the spike's step was logged half a second before the push's last one.
    assert spike["time"] == base - support.NORMAL_STEP and nonfinite["time"] == base
    for event in events:
        assert kinds(event) == ["hyperparameter"] and event["causes"][0]["score"] == thresholds.score("hyperparameter")
        assert event["causes"][0]["evidence"].startswith("learning_rate jumped from 0.03 to 300 (x1e+04)")
        assert event["sentence"].endswith("after the learning rate jumped from 0.03 to 300; all 2 ranks affected: "
                                          "a hyper-parameter change, not the GPU"), event["sentence"]
    assert "gradient norm 80, 72.7x its median over the 30 min before" in spike["sentence"]
    code, out, _ = explain(prometheus, "lr-jump", capsys)
    lines = [line for line in out.splitlines() if not line.startswith(" ")]
    assert [line.split()[3] for line in lines[1:]] == ["grad_spike:", "nonfinite:"]  # the text, in time order


def test_the_alert_and_explain_size_a_spike_alike(prometheus, capsys, tmp_path):
    """One computation (explain's GRAD_SPIKE_RATIO, in the alert's description too): on the same samples,
    TrainingGradientExplosion's description (promtool evaluating the real rules) and explain say the same."""
    spike = timeline(prometheus, "lr-jump", capsys)["events"][0]
    size = re.search(r"gradient norm (\S+), (\S+x) its median over the 30 min before", spike["sentence"])
    rule = " ".join(yaml.safe_load((REPO / "rules" / "alerts.yml").read_text())["groups"][0]["rules"][2]
                    ["annotations"]["description"].split())
    assert explain_events.GRAD_SPIKE_RATIO.replace("{SEL}", "{%s}") in rule
    samples = list(support.training_samples("lr-jump", 0, 2, 31))
    labels = 'job="train",run="lr-jump",rank="0",instance="lr-jump-node0"'
    names = ("training_grad_norm_max", "training_grad_norm_max_step", "training_step",
             "training_nonfinite_steps_total", "training_first_nonfinite_step")
    series = [{"series": f"{name}{{{labels}}}", "values": " ".join(str(values[name]) for _, _, _, values in samples)}
              for name in names]
    series.append({"series": f'training_run_state{{{labels},state="running"}}', "values": f"1x{len(samples) - 1}"})
    at = int(support.FAULT_AT)
    median = 1.1  # the norms before: 1.0, 1.1, 1.2 in turn
    description = (f"Run lr-jump (job train, rank 0, host lr-jump-node0): gradient norm reached {size[1]} at step "
                   f"{spike['step']}, {size[2]} its median over the 30 min before ({median:.4g}). The run went "
                   f"non-finite from step {spike['step'] + 1} on.")
    tests = tmp_path / "agree_test.yml"
    tests.write_text(yaml.safe_dump({
        "rule_files": [str(REPO / "rules" / "recording.yml"), str(REPO / "rules" / "alerts.yml")],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "alert_rule_test": [
            {"eval_time": f"{at}s", "alertname": "TrainingGradientExplosion", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "job": "train", "run": "lr-jump", "rank": "0",
                               "instance": "lr-jump-node0"},
                "exp_annotations": {
                    "summary": "Gradient explosion in run lr-jump rank 0", "description": description,
                    "runbook_url": "#traininggradientexplosion",
                    "infra_cause": "none: the run reports no GPU; dualtrack explain lr-jump has the timeline.",
                    "dashboard_url": ""}}]}]}]}))  # no Grafana configured
    done = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_model_events_spike_loss_scale_and_oom(prometheus, capsys):
    events = timeline(prometheus, "model", capsys)["events"]
    assert [(e["kind"], e["rank"]) for e in events] == [("grad_spike", "0"), ("loss_scale_collapse", "0"),
                                                         ("oom", "1")]
    spike, collapse, oom = events
    assert spike["time"] == prometheus["base"] + support.FAULT_AT and spike["step"] is not None
    assert kinds(spike) == ["none_found"] and kinds(collapse) == ["none_found"]
    assert "no other rank affected: no GPU evidence, so the model or its input" in spike["sentence"]
    assert kinds(oom) == ["memory_pressure"] and oom["causes"][0]["score"] == 0.8
    assert oom["gpu_uuid"] == support.uuid_of("model", 1)


def test_a_loss_scale_that_drifts_down_for_hours_is_no_collapse(tmp_path, capsys):
    """TrainingLossScaleCollapse compares the scale with its maximum over the last hour: a scale halving
    every 8 min falls 1024x below its start after 80 min, yet never 1024x within an hour. Neither the
    alert's condition nor explain sees a collapse (the run's own maximum would)."""
    base = (time.time() // 3600 - 4) * 3600
    support.backfill({"scale-drift": "scale-drift"}, base, tmp_path / "prometheus-data", tmp_path,
                     minutes=support.DRIFT_MINUTES)
    end = base + support.DRIFT_MINUTES * 60
    run = '{run="scale-drift"}'
    over_run = f"[{int(end - base)}s:{int(support.SCRAPE)}s]"
    alert = explain_events.LOSS_SCALE_COLLAPSE.replace("{SEL}", run)
    whole_run = f"training_loss_scale{run} < max_over_time(training_loss_scale{run}[{int(end - base)}s]) / 1024"
    with support.serving(tmp_path) as url:
        assert daemons.query(url, f"count_over_time(({alert}){over_run})", at=end) == []
        assert daemons.query(url, f"count_over_time(({whole_run}){over_run})", at=end), "the scale never fell 1024x"
        window = ["--since", str(base), "--until", str(end + 100)]
        assert main(["explain", "scale-drift", "--prometheus", url, *window, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["events"] == []


def test_bad_input_gets_one_line(prometheus, capsys, monkeypatch):
    monkeypatch.delenv("DUALTRACK_PROMETHEUS", raising=False)
    code, out, err = explain(prometheus, "no-such-run", capsys)
    assert code == 1 and out == "" and err.count("\n") == 1 and "no training_step series" in err
    assert main(["explain", "healthy"]) == 2
    assert "no Prometheus" in capsys.readouterr().err
    assert main(["explain", "healthy", "--prometheus", prometheus["url"], "--since", "yesterday"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    # Undecodable bytes in argv (surrogates) are no label value: one line, not a traceback from the URL.
    for args in (["\udcff"], ["healthy", "--launch", "\udcfe"]):
        assert main(["explain", *args, "--prometheus", prometheus["url"]]) == 2
        assert capsys.readouterr().err.endswith("not UTF-8 text\n")
    code = main(["explain", "healthy", "--prometheus", f"http://127.0.0.1:{processes.free_port()}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err


def test_times_that_are_not_finite_get_one_line(prometheus, capsys):
    for flag, value in (("--since", "-inf"), ("--until", "inf"), ("--since", "nan"), ("--until", "1e999"),
                        ("--since", "9" * 400 + "d")):
        assert main(["explain", "healthy", "--prometheus", prometheus["url"], f"{flag}={value}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} " in err and "not a finite time" in err, err


def test_times_are_unix_seconds_iso_8601_or_a_duration_ago():
    """--since/--until: a duration with its unit is read by the command's one duration parser."""
    now = 1_800_000_000.0
    for text, expected in (("90m", now - 5400), ("1.5h", now - 5400), ("250ms", now - 0.25), (" 2d ", now - 172800),
                           ("1700000000", 1.7e9), ("2026-12-03T10:00:00Z", 1796292000.0),
                           ("2026-12-03T10:00:00", 1796292000.0)):
        assert parse_time(text, now, "--since") == expected, text
    for text in ("yesterday", "90 minutes", "h"):
        with pytest.raises(ValueError, match="^--since"):
            parse_time(text, now, "--since")


def test_control_characters_in_labels_are_escaped_in_the_text():
    hostile = "\x1b]0;owned\x07\x1b[2J\x9b31m"
    found = Timeline(
        f"r{hostile}", f"j{hostile}", 0.0, 60.0, {"0": f"GPU-{hostile}"},
        [Event("straggler", 7, 30.0, "0", f"GPU-{hostile}", "stepped at 50% of the run's median rate",
               causes=[Cause("co_tenant", f"process {hostile}\nfake line", 0.7)], sentence=f"step 7: ... ({hostile})")])
    text = render_text(found)
    assert not any(c in text for c in "\x1b\x07\x9b") and text.count("\n") == 2
    assert "\\x1b]0;owned\\x07\\x1b[2J\\x9b31m" in text and "\\nfake line" in text


def test_the_report_has_the_timeline_and_the_goodput(prometheus, tmp_path, capsys):
    record = tmp_path / "starving.jsonl"
    base = prometheus["base"]
    with open(record, "w") as out:
        out.write(json.dumps({"event": "start", "format": 2, "time": base, "job": "train", "run": "starving",
                              "rank": 0, "instance": "starving-node0", "config": {}}) + "\n")
        for n in range(361):
            out.write(json.dumps({"time": base + n * 10, "step": n, "values": {"loss": 1.0}}) + "\n")
    out_html = tmp_path / "report.html"
    assert main(["report", str(record), "--out", str(out_html), "--prometheus", prometheus["url"]]) == 0, \
        capsys.readouterr().err
    page = out_html.read_text()
    timeline = page.split('<table id="timeline">')[1].split("</table>")[0]
    assert re.findall(r'data-kind="(\w+)"', timeline) == ["step_time_regression", "data_starvation"]
    assert "the input pipeline, not the GPU or the model" in timeline and "data_wait" in timeline
    goodput = page.split('<table id="goodput">')[1].split("</table>")[0]
    # Half the run at 100 %, half at 40 % (60 % data wait).
    share = float(re.search(r"<td>([\d.]+)%</td>", goodput).group(1))
    assert 65 <= share <= 75, goodput
    assert "no max_steps logged" in goodput
    assert "<td>checkpoint 2.0 min</td>" in goodput  # every rank paused 2 min for a checkpoint


def test_credentials_never_reach_the_output_and_torch_is_never_imported(tmp_path, capsys):
    secret = tmp_path / "password"
    secret.write_text("hunter2-secret\n")
    code = main(["explain", "healthy", "--prometheus", f"https://127.0.0.1:{processes.free_port()}",
                 "--prometheus-username", "me", "--prometheus-password-file", str(secret)])
    out = capsys.readouterr()
    assert code == 1 and "hunter2" not in out.out + out.err and out.err.count("\n") == 1
    probe = ("import sys; from dualtrack.cli import build_parser; build_parser(); "
             "import dualtrack.explain, dualtrack.goodput; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.strip() == "False", done.stderr
