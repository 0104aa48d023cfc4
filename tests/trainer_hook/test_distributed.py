"""Real torchrun launches (2 ranks, gloo on CPU) through a real Pushgateway and Prometheus."""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from stack import processes
from tests.support import daemons
from tests.support.distributed import finish
from tests.support.hook import pushed_value, record_lines, run_id
from tests.support.paths import REPO, SUPPORT
from tests.support.process import alive, kill_tree

pytest.importorskip("lightning")
pytestmark = pytest.mark.e2e

WORKER = SUPPORT / "distributed_worker.py"


@pytest.fixture
def stack(tmp_path, start_service):
    """A Pushgateway and a Prometheus (the repo's rules) scraping it every second."""
    pgw = start_service(processes.pushgateway(tmp_path))
    config = processes.render_prometheus_config(tmp_path, {processes.PUSHGATEWAY_JOB: [pgw.address]},
                                                scrape_interval="1s", evaluation_interval="1s")
    return pgw, start_service(processes.prometheus(tmp_path, config))


def torchrun(mode: str, records: Path, run: str, pushgateway: str | None = None, ranks: int = 2) -> subprocess.Popen:
    # DUALTRACK_DELETE_AFTER=none: the final state stays on this test's own Pushgateway, and no
    # rank waits at exit to delete its group.
    env = {**os.environ, "DUALTRACK_RUN": run, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "DUALTRACK_DELETE_AFTER": "none"}
    env.pop("DUALTRACK_PUSHGATEWAY", None)
    if pushgateway:
        env["DUALTRACK_PUSHGATEWAY"] = pushgateway
    log = open(records / f"torchrun-{mode}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={ranks}", str(WORKER), mode, str(records)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def ranks(result: list[dict]) -> dict[str, float]:
    return {series["metric"]["rank"]: float(series["value"][1]) for series in result}


def test_ddp_ranks_share_one_run_in_prometheus_and_record_one_file_each(stack, tmp_path):
    pgw, prom = stack
    run = run_id("ddp")
    finish(torchrun("ddp", tmp_path, run, pgw.url), tmp_path)

    steps = daemons.wait_for_series(prom.url, f'training_steps_total{{job="ddp",run="{run}"}}',
                                      predicate=lambda r: ranks(r) == {"0": 8, "1": 8})
    assert {series["metric"]["instance"] for series in steps} == {os.uname().nodename}
    # rank_zero_only: rank 0 reported, rank 1 never pushed nor wrote a record.
    daemons.wait_for_series(prom.url, f'training_steps_total{{job="ddp-rank0",run="{run}"}}',
                              predicate=lambda r: ranks(r) == {"0": 8})
    assert pushed_value(pgw.url, "training_steps_total", run, job="ddp-rank0", rank="1") is None
    assert sorted(path.name for path in tmp_path.glob("*.jsonl")) == sorted(
        [f"ddp-{run}-rank0.jsonl", f"ddp-{run}-rank1.jsonl", f"ddp-rank0-{run}-rank0.jsonl"])

    per_rank = {rank: record_lines(tmp_path / f"ddp-{run}-rank{rank}.jsonl") for rank in (0, 1)}
    for rank, (lines, events) in per_rank.items():
        assert events[0]["rank"] == rank and events[0]["config"]["world_size"] == "2"
        assert [line["step"] for line in lines] == list(range(1, 9))
    # Gradients are all-reduced before the optimizer step: one global norm, different local losses.
    zero, one = per_rank[0][0], per_rank[1][0]
    for a, b in zip(zero, one):
        assert a["values"]["grad_norm"] == pytest.approx(b["values"]["grad_norm"], rel=1e-6)
    assert [a["values"]["loss"] for a in zero] != [b["values"]["loss"] for b in one]


def test_hugging_face_and_accelerate_report_every_rank(tmp_path):
    run = run_id("fw")
    finish(torchrun("frameworks", tmp_path, run), tmp_path)
    for job in ("hf", "accelerate"):
        zero, one = (record_lines(tmp_path / f"{job}-{run}-rank{rank}.jsonl") for rank in (0, 1))
        assert (zero[1][0]["rank"], one[1][0]["rank"]) == (0, 1)
        assert len(zero[0]) == len(one[0]) == 8
        for a, b in zip(zero[0], one[0]):  # all-reduced gradients: one norm; each rank its loss
            assert a["values"]["grad_norm"] == pytest.approx(b["values"]["grad_norm"], rel=1e-6)
        assert [a["values"]["loss"] for a in zero[0]] != [b["values"]["loss"] for b in one[0]]
    assert record_lines(tmp_path / f"hf-{run}-rank1.jsonl")[1][0]["config"]["world_size"] == "2"


def test_a_slow_rank_shows_in_the_step_rate_spread_and_the_straggler_alert(stack, tmp_path):
    pgw, prom = stack
    run = run_id("strag")
    proc = torchrun("straggler", tmp_path, run, pgw.url)
    try:
        spread = (f'job_run:training_steps:rate5m_max{{run="{run}"}}'
                  f' / job_run:training_steps:rate5m_min{{run="{run}"}}')
        daemons.wait_for_series(prom.url, spread, timeout=90,
                                  predicate=lambda r: r and float(r[0]["value"][1]) > 2)
        rates = ranks(daemons.query(prom.url, f'rate(training_steps_total{{run="{run}"}}[5m])'))
        assert rates["1"] < rates["0"] / 2
        pending = daemons.wait_for_series(
            prom.url, f'ALERTS{{alertname="TrainingStragglerRank",run="{run}"}}', timeout=30)
        assert [(a["metric"]["rank"], a["metric"]["alertstate"]) for a in pending] == [("1", "pending")]
    finally:
        (tmp_path / "stop").touch()
    finish(proc, tmp_path)


#: TrainingRankHung's two windows as shipped (rules/distributed.yml, in seconds: 4 min without a step,
#: 60 s without a push) and as the test below runs them, so that a hang fires in seconds.
HANG_WINDOWS = {"240": "10", "60": "5"}


#: TrainingStragglerRank's collective-wait rule as shipped (2-min rates, 5 min `for`) and as the tests
#: below run it.
STRAGGLER_WINDOWS = {"[2m]": "[10s]", "5m": "4s"}


def shortened_hang_rules(workdir: Path) -> Path:
    """The shipped `dualtrack-hang.alerts` group with only its windows shortened (HANG_WINDOWS):
    every other character of its rules' expressions and annotations is as shipped."""
    groups = yaml.safe_load((processes.RULES_DIR / "distributed.yml").read_text())["groups"]
    [group] = [group for group in groups if group["name"] == "dualtrack-hang.alerts"]
    [alert] = [rule for rule in group["rules"] if "alert" in rule]
    assert alert["alert"] == "TrainingRankHung" and "for" not in alert
    for shipped, short in HANG_WINDOWS.items():
        window = re.compile(rf"(?<![\w.]){shipped}(?![\w.])")
        assert window.search(alert["expr"]), f"window {shipped} s not in the rule: update HANG_WINDOWS"
        for rule in group["rules"]:
            rule["expr"] = window.sub(short, rule["expr"])
            rule["annotations"] = {key: window.sub(short, text) for key, text in rule.get("annotations", {}).items()}
    path = workdir / "hang.yml"
    path.write_text(yaml.safe_dump({"groups": [group]}, width=1 << 16))
    return path


def shortened_straggler_rules(workdir: Path) -> Path:
    """The shipped collective-wait recording rules and TrainingStragglerRank rules, the lockstep
    rule's rate window and `for` shortened (STRAGGLER_WINDOWS), the rest as shipped."""
    groups = yaml.safe_load((processes.RULES_DIR / "distributed.yml").read_text())["groups"]
    kept = []
    for group in groups:
        rules = [rule for rule in group["rules"] if "collective_wait" in rule.get("record", "")
                 or rule.get("alert") == "TrainingStragglerRank"]
        for rule in rules:
            if "record" in rule:
                rule["expr"] = rule["expr"].replace("[2m]", STRAGGLER_WINDOWS["[2m]"])
            elif rule["labels"].get("basis") == "collective_wait":
                assert rule["for"] == "5m", "update STRAGGLER_WINDOWS"
                rule["for"] = STRAGGLER_WINDOWS["5m"]
        if rules:
            kept.append({**group, "rules": rules})
    assert STRAGGLER_WINDOWS["[2m]"] in str(kept), "the rate window is not in the rules: update STRAGGLER_WINDOWS"
    path = workdir / "straggler.yml"
    path.write_text(yaml.safe_dump({"groups": kept}, width=1 << 16))
    return path


def stack_with(tmp_path: Path, start_service, *rule_files: Path) -> tuple:
    """A Pushgateway and a Prometheus scraping it every second, evaluating only `rule_files`."""
    pgw = start_service(processes.pushgateway(tmp_path))
    config = processes.render_prometheus_config(tmp_path, {processes.PUSHGATEWAY_JOB: [pgw.address]},
                                                scrape_interval="1s", evaluation_interval="1s")
    rendered = yaml.safe_load(config.read_text())
    rendered["rule_files"] = [str(path) for path in rule_files]
    config.write_text(yaml.safe_dump(rendered, sort_keys=False))
    return pgw, start_service(processes.prometheus(tmp_path, config))


def test_a_frozen_rank_is_the_one_the_hang_alert_names(tmp_path, start_service):
    """Two ranks on gloo step through one all-reduce per step; rank 1 is stopped with SIGSTOP, so its
    hook's pushes stop too while rank 0 waits in the collective and still pushes. TrainingRankHung
    (its windows shortened, see HANG_WINDOWS) names rank 1 alone, was silent while both ranks
    stepped, and resolves once rank 1 resumes and the run finishes."""
    pgw, prom = stack_with(tmp_path, start_service, shortened_hang_rules(tmp_path))
    run = run_id("hang")
    alerts = f'ALERTS{{alertname="TrainingRankHung",run="{run}",alertstate="firing"}}'
    proc = torchrun("hang", tmp_path, run, pgw.url)
    frozen = None
    try:
        # Both ranks step, and Prometheus has seen them do so for longer than the hang window.
        window = float(HANG_WINDOWS["240"])
        daemons.wait_for_series(
            prom.url, f'count_over_time(training_steps_total{{job="hang",run="{run}"}}[1h]) > {window + 3}'
            f' and training_steps_total > 0', timeout=120, predicate=lambda r: len(r) == 2)
        frozen = int((tmp_path / "rank1.pid").read_text())
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.time()
        firing = daemons.wait_for_series(prom.url, alerts, timeout=60)
        assert [series["metric"]["rank"] for series in firing] == ["1"]
        assert daemons.query(prom.url, f'count_over_time({alerts}[1h])', at=stopped_at) == []
        [alert] = [a for a in requests.get(f"{prom.url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
                   if a["labels"].get("run") == run]
        assert alert["annotations"]["summary"].startswith(f"Run {run} hangs: rank 1 stopped reporting at step ")
        assert "Rank 1 on host" in alert["annotations"]["description"], alert["annotations"]
        assert f"py-spy dump --pid {frozen} " in alert["annotations"]["description"]
        # Thawed, the ranks agree to stop in their next all-reduce and finish: the alert resolves.
        (tmp_path / "stop").touch()
        os.kill(frozen, signal.SIGCONT)
        finish(proc, tmp_path, timeout=60)
        processes.wait_until(lambda: not daemons.query(prom.url, alerts), 30, what="the alert to resolve")
    finally:
        (tmp_path / "stop").touch()
        if frozen is not None and alive({frozen}):
            os.kill(frozen, signal.SIGCONT)  # whatever happened, no stopped process outlives the test
        kill_tree(proc.pid)
        proc.wait()


def test_under_ddp_the_hung_rank_and_the_straggler_are_the_ranks_the_others_wait_for(tmp_path, start_service):
    """Three DDP ranks (gloo), watch() timing their all-reduces, the alerts' windows shortened
    (HANG_WINDOWS, STRAGGLER_WINDOWS). Healthy, neither TrainingStragglerRank nor TrainingRankHung
    fires. Rank 1's data iterator blocks while ranks 0 and 2 wait in the all-reduce: TrainingRankHung
    names rank 1 alone, in its data loader, with its frame; released, the alert resolves. Then rank 1
    takes 45 ms more before its forward: every rank's step rate drops alike (lockstep), and
    TrainingStragglerRank names rank 1 alone, the rank that waits least."""
    pgw, prom = stack_with(tmp_path, start_service, shortened_straggler_rules(tmp_path),
                           shortened_hang_rules(tmp_path))
    run = run_id("lockstep")
    proc = torchrun("sync", tmp_path, run, pgw.url, ranks=3)
    try:
        # Healthy: Prometheus has seen every rank's wait share, and its steps, for longer than the windows.
        alerts = quiet_lockstep(prom.url, run, evaluations=15, timeout=120)
        hang_names_rank_1(prom.url, run, tmp_path, "loader", "in its data loader", "batches (distributed_worker.py:")
        (tmp_path / "slow").touch()
        firing = daemons.wait_for_series(prom.url, alerts.replace("}", ',alertstate="firing"}'), timeout=90)
        assert [(a["metric"]["alertname"], a["metric"]["rank"]) for a in firing] == [("TrainingStragglerRank", "1")]
        [alert] = [a for a in requests.get(f"{prom.url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
                   if a["labels"].get("run") == run and a["state"] == "firing"]
        assert alert["annotations"]["summary"] == f"Run {run} rank 1 is a straggler: the other ranks wait for it"
        assert "rank 1 on host" in alert["annotations"]["description"]
        rates = ranks(daemons.query(prom.url, f'rate(training_steps_total{{run="{run}"}}[10s])'))
        assert max(rates.values()) < 1.2 * min(rates.values()), rates  # lockstep: no step-rate straggler
    finally:
        (tmp_path / "stop").touch()
        (tmp_path / "release").touch()
    finish(proc, tmp_path)
    # watch()'s communication hook still all-reduces: every rank's gradient norm is the same at each step
    norms = [[line["values"]["grad_norm"] for line in record_lines(tmp_path / f"sync-{run}-rank{rank}.jsonl")[0]]
             for rank in range(3)]
    assert len(norms[0]) > 100 and norms[0] == norms[1] == norms[2]


@pytest.mark.slow
@pytest.mark.ddp
def test_under_ddp_a_rank_stuck_computing_is_the_one_the_hang_alert_names(tmp_path, start_service):
    """Three DDP ranks (gloo) at the same step; rank 1 blocks in its own code before its forward
    while ranks 0 and 2 wait in the all-reduce: TrainingRankHung names rank 1 alone, computing."""
    pgw, prom = stack_with(tmp_path, start_service, shortened_hang_rules(tmp_path))
    run = run_id("ddphang")
    proc = torchrun("sync", tmp_path, run, pgw.url, ranks=3)
    try:
        daemons.wait_for_series(
            prom.url, f'count_over_time(training_steps_total{{run="{run}"}}[1h]) > {float(HANG_WINDOWS["240"]) + 3}'
            f' and training_steps_total > 0', timeout=120, predicate=lambda r: len(r) == 3)
        hang_names_rank_1(prom.url, run, tmp_path, "compute", "computing", "custom_kernel (distributed_worker.py:")
    finally:
        (tmp_path / "stop").touch()
        (tmp_path / "release").touch()
    finish(proc, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_under_ddp_the_shipped_rules_name_the_straggler_within_10_minutes(stack, tmp_path):
    """Real time, the rules as shipped: three DDP ranks healthy for 2.5 min raise nothing; then rank 1
    takes 45 ms more before its forward, and TrainingStragglerRank names rank 1 alone within 10 min."""
    pgw, prom = stack
    run = run_id("lockstep-long")
    proc = torchrun("sync", tmp_path, run, pgw.url, ranks=3)
    try:
        # 2.5 min of wait shares (one evaluation a second)
        alerts = quiet_lockstep(prom.url, run, evaluations=150, timeout=300)
        (tmp_path / "slow").touch()
        onset = time.time()
        firing = daemons.wait_for_series(prom.url, alerts.replace("}", ',alertstate="firing"}'), timeout=600)
        assert [(a["metric"]["alertname"], a["metric"]["rank"]) for a in firing] == [("TrainingStragglerRank", "1")]
        assert time.time() - onset < 600
    finally:
        (tmp_path / "stop").touch()
    finish(proc, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_healthy_ddp_run_raises_no_straggler_nor_hang_in_20_minutes(stack, tmp_path):
    """Real time, the rules as shipped: three healthy DDP ranks for 20 min, neither TrainingStragglerRank
    nor TrainingRankHung, not even pending."""
    pgw, prom = stack
    run = run_id("lockstep-healthy")
    proc = torchrun("sync", tmp_path, run, pgw.url, ranks=3)
    try:
        quiet_lockstep(prom.url, run, evaluations=1200, timeout=1500)
    finally:
        (tmp_path / "stop").touch()
    finish(proc, tmp_path)


def quiet_lockstep(prometheus: str, run: str, evaluations: int, timeout: float) -> str:
    """Wait until Prometheus evaluated each of the run's 3 ranks' collective-wait share more than
    `evaluations` times, and check that neither TrainingStragglerRank nor TrainingRankHung was ever
    pending or firing for it; returns the selector of those alerts."""
    alerts = f'ALERTS{{alertname=~"TrainingStragglerRank|TrainingRankHung",run="{run}"}}'
    shares = f'job_run_rank:training_collective_wait:ratio2m{{run="{run}"}}'
    daemons.wait_for_series(prometheus, f"count_over_time({shares}[1h]) > {evaluations}", timeout=timeout,
                            predicate=lambda r: len(r) == 3)
    assert daemons.query(prometheus, f"count_over_time({alerts}[1h])") == []
    return alerts


def hang_names_rank_1(prometheus: str, run: str, records: Path, where: str, phase: str, frame: str) -> None:
    """Block rank 1 of a `sync` run (distributed_worker.py) `where` ("loader", "compute"); TrainingRankHung
    names rank 1 alone, with its phase and frame; released, the run steps again and the alert resolves."""
    alerts = f'ALERTS{{alertname="TrainingRankHung",run="{run}",alertstate="firing"}}'
    (records / f"hang-{where}").touch()
    firing = daemons.wait_for_series(prometheus, alerts, timeout=60)
    assert [series["metric"]["rank"] for series in firing] == ["1"], where
    [alert] = [a for a in requests.get(f"{prometheus}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
               if a["labels"].get("run") == run and a["labels"]["alertname"] == "TrainingRankHung"]
    summary, description = alert["annotations"]["summary"], alert["annotations"]["description"]
    assert re.match(rf"Run {run} hangs: rank 1 is {phase} at step \d+, the others inside collective \d+$",
                    summary), summary
    assert "but not inside the collective they wait in" in description, description
    assert f"Its training thread is {phase}, in {frame}" in description, description
    (records / "release").touch()
    processes.wait_until(lambda: not daemons.query(prometheus, alerts), 60, what="the alert to resolve")
    (records / f"hang-{where}").unlink()
    (records / "release").unlink()


def test_fsdp_grad_norms_are_global_or_absent_never_a_shards(tmp_path):
    """FSDP2: clip_grad_norm_ and grad_norm() give the global norm. FSDP1 with use_orig_params:
    the module's clip_grad_norm_ is global, and watch() captures no grad norm (a rank's parameters
    are views of its shard) but says why."""
    run = run_id("fsdp")
    finish(torchrun("fsdp", tmp_path, run), tmp_path)
    zero, one = (record_lines(tmp_path / f"fsdp-{run}-rank{rank}.jsonl")[0] for rank in (0, 1))
    assert len(zero) == len(one) == 3
    for a, b in zip(zero, one):
        for values in (a["values"], b["values"]):
            assert values["grad_norm"] == pytest.approx(values["full_grad_norm"], rel=1e-5)
            assert values["fused_grad_norm"] == pytest.approx(values["full_grad_norm"], rel=1e-5)
            assert values["shard_grad_norm"] < values["grad_norm"] * 0.999  # what a shard alone says
        shards = math.hypot(a["values"]["shard_grad_norm"], b["values"]["shard_grad_norm"])
        assert shards == pytest.approx(a["values"]["grad_norm"], rel=1e-5)
    log = (tmp_path / "torchrun-fsdp.log").read_text()
    for rank in (0, 1):
        lines = record_lines(tmp_path / f"fsdp1-{run}-rank{rank}.jsonl")[0]
        assert len(lines) == 3
        for line in lines:
            values = line["values"]
            assert "grad_norm" not in values, values  # not this rank's shard passed off as the total
            assert values["clip_grad_norm"] == pytest.approx(values["full_grad_norm"], rel=1e-5)
            assert values["shard_grad_norm"] < values["full_grad_norm"] * 0.999
    assert log.count("grad_norm is not captured") == 2, log[-3000:]  # once per rank
