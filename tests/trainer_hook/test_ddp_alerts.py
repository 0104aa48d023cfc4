"""Three real DDP ranks (torchrun, gloo on CPU) through a real Pushgateway and Prometheus with the
project's rules: a checkpoint pause is not a hang (until its bound), a corrupted replica is named,
a healthy run raises nothing. The rules' windows are shortened to seconds (SHORTENED) and nothing
else is changed."""
from __future__ import annotations

import re
import time

import pytest
import yaml

from stack import processes
from tests.support import daemons
from tests.support.distributed import finish, torchrun
from tests.support.hook import pushed_value, run_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ddp]

#: Seconds as shipped -> as run here: the hang window (240), a rank's push silence (60), the pause
#: bound (900, dualtrack/thresholds.py PAUSE_MAX).
SHORTENED = {"240": "6", "60": "5", "900": "20"}
BOUND = float(SHORTENED["900"])


def shortened(text: str) -> str:
    for shipped, short in SHORTENED.items():
        text = re.sub(rf"(?<![\w.]){shipped}(?![\w.])", short, text)
    return text


@pytest.fixture
def stack(tmp_path, start_service):
    """A Pushgateway and a Prometheus scraping it every second, with rules/pause.yml,
    rules/replica.yml and TrainingRankHung, their windows shortened."""
    pgw = start_service(processes.pushgateway(tmp_path))
    config = processes.render_prometheus_config(tmp_path, {processes.PUSHGATEWAY_JOB: [pgw.address]},
                                                scrape_interval="1s", evaluation_interval="1s")
    groups = [group for name in ("pause", "replica", "distributed")
              for group in yaml.safe_load((processes.RULES_DIR / f"{name}.yml").read_text())["groups"]
              if group["name"] != "dualtrack-distributed.alerts"]
    rules = tmp_path / "rules.yml"
    rules.write_text(shortened(yaml.safe_dump({"groups": groups}, width=1 << 16)))
    rendered = yaml.safe_load(config.read_text())
    rendered["rule_files"] = [str(rules)]
    config.write_text(yaml.safe_dump(rendered, sort_keys=False))
    return pgw, start_service(processes.prometheus(tmp_path, config))


def alerts(prom, run: str, name: str, state: str = "firing") -> list[str]:
    return sorted(series["metric"]["rank"] for series in daemons.query(
        prom.url, f'ALERTS{{alertname="{name}",run="{run}",alertstate="{state}"}}'))


def stepping(prom, run: str, job: str, steps: int) -> None:
    daemons.wait_for_series(prom.url, f'training_steps_total{{job="{job}",run="{run}"}} >= {steps}', timeout=120,
                            predicate=lambda r: len(r) == 3)


def test_a_checkpoint_pause_is_not_a_hang_until_its_bound(stack, tmp_path):
    """Every rank enters paused("checkpoint"); rank 0 "writes" while the others wait in a barrier.
    No hang alert while the pause lasts less than its bound (the hang window passes three times over),
    then TrainingPauseTooLong names every paused rank and the pause's reason."""
    pgw, prom = stack
    run = run_id("ckpt")
    proc = torchrun("pause", tmp_path, run, pgw.url)
    try:
        stepping(prom, run, "ddp-pause", 50)
        (tmp_path / "pause").touch()
        processes.wait_until(lambda: (tmp_path / "writing").exists(), 30, what="rank 0 writing its checkpoint")
        paused_at = time.time()
        daemons.wait_for_series(prom.url, f'job_run:training_pause:seconds{{run="{run}"}}', timeout=10)
        processes.wait_until(lambda: time.time() - paused_at > 3 * float(SHORTENED["240"]), 30, what="3 hang windows")
        assert daemons.query(prom.url, f'count_over_time(ALERTS{{run="{run}"}}[1h])') == []
        daemons.wait_for_series(prom.url, f'ALERTS{{alertname="TrainingPauseTooLong",run="{run}",alertstate="firing"}}',
                                timeout=BOUND + 20, predicate=lambda r: len(r) == 3)
        assert time.time() - paused_at > BOUND
        alerts = daemons.query(prom.url, f'ALERTS{{alertname="TrainingPauseTooLong",run="{run}"}}')
        [reason] = {s["metric"]["reason"] for s in alerts}
        assert reason == "checkpoint"
        assert daemons.query(prom.url,
                             f'training_paused_seconds_total{{run="{run}",reason="checkpoint"}} > {BOUND / 2}')
    finally:
        (tmp_path / "written").touch()
        (tmp_path / "stop").touch()
    finish(proc, tmp_path, timeout=60)


def test_a_corrupted_replica_is_named_alone_and_a_healthy_run_raises_nothing(stack, tmp_path):
    """Rank 2's gradient gets one element + 1e-3 after the all-reduce, every step: TrainingReplicaDivergence
    names rank 2 alone. Then a healthy run of the same loop: no alert at all."""
    pgw, prom = stack
    corrupt, healthy = run_id("sdc"), run_id("ddp")
    proc = torchrun("corrupt", tmp_path, corrupt, pgw.url)
    try:
        daemons.wait_for_series(prom.url, f'ALERTS{{alertname="TrainingReplicaDivergence",run="{corrupt}",'
                                          f'alertstate="firing"}}', timeout=120)
        time.sleep(2)  # a few more evaluations: still rank 2 alone
        assert alerts(prom, corrupt, "TrainingReplicaDivergence") == ["2"]
        compared = daemons.query(prom.url, f'training_replica_compared_steps_total{{run="{corrupt}"}}')
        assert len(compared) == 3 and all(float(s["value"][1]) > 0 for s in compared)
    finally:
        (tmp_path / "stop").touch()
    finish(proc, tmp_path, timeout=60)
    (tmp_path / "stop").unlink()
    proc = torchrun("healthy", tmp_path, healthy, pgw.url)
    try:
        stepping(prom, healthy, "ddp-healthy", 200)
        daemons.wait_for_series(prom.url, f'training_replica_compared_steps_total{{run="{healthy}"}} >= 20',
                                predicate=lambda r: len(r) == 3)
        assert daemons.query(prom.url, f'count_over_time(ALERTS{{run="{healthy}"}}[1h])') == []
        assert daemons.query(prom.url, f'training_replica_divergent_steps_total{{run="{healthy}"}} > 0') == []
    finally:
        (tmp_path / "stop").touch()
    finish(proc, tmp_path, timeout=60)


def test_a_rank_that_never_compares_blocks_no_training(tmp_path, start_service):
    """Rank 1 does not watch() its DDP model: ranks 0 and 2 wait for its norm on their own thread
    only, and every rank goes on stepping."""
    pgw = start_service(processes.pushgateway(tmp_path))
    run = run_id("subset")
    proc = torchrun("subset", tmp_path, run, pgw.url)
    try:
        processes.wait_until(
            lambda: all((pushed_value(pgw.url, "training_steps_total", run, rank=str(rank)) or 0) >= 100
                        for rank in range(3)),
            120, what="100 steps on every rank")
    finally:
        (tmp_path / "stop").touch()
    finish(proc, tmp_path, timeout=60)
    assert [pushed_value(pgw.url, "training_replica_compared_steps_total", run, rank=str(rank))
            for rank in range(3)] == [0, None, 0]
