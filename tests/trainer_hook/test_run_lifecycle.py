"""A run's life on the Pushgateway: its final state stays `delete_after` seconds, then its group is
deleted; Prometheus keeps the history. Real Pushgateway and Prometheus, real processes."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from stack import processes
from tests.support import daemons
from tests.support.hook import pushed_value, run_id, wait_pushed
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor, push
from trainer_hook.settings import ENV_DELETE_AFTER

pytestmark = pytest.mark.e2e


def group_runs(pushgateway_url: str, job: str) -> set[str]:
    data = requests.get(pushgateway_url + "/api/v1/metrics", timeout=5).json()["data"]
    return {group["labels"]["run"] for group in data if group["labels"]["job"] == job}


def series_count(pushgateway_url: str, job: str) -> int:
    """Series the Pushgateway serves for `job` (what Prometheus ingests from it on every scrape), but the
    training thread's frame, which a rank reports once it has logged no step for two push intervals."""
    text = requests.get(pushgateway_url + "/metrics", timeout=5).text
    return sum(1 for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.labels.get("job") == job and sample.name != "training_rank_frame_info")


@pytest.fixture
def pgw(tmp_path, start_service):
    return start_service(processes.pushgateway(tmp_path))


def test_final_state_stays_delete_after_seconds_then_the_group_is_deleted(pgw):
    run, kept = run_id("ends"), run_id("kept")
    with TrainingMonitor(job="life", run=kept, pushgateway=pgw.url, record_path=False, delete_after=None) as m:
        m.log({"loss": 0.5}, step=0)
    closed_at = time.monotonic()
    with TrainingMonitor(job="life", run=run, pushgateway=pgw.url, record_path=False, delete_after=1.5) as m:
        for step in range(5):
            m.log({"loss": 0.5}, step=step)
    # close() returned at once, with the final state pushed.
    assert pushed_value(pgw.url, "training_run_state", run, state="finished") == 1
    assert pushed_value(pgw.url, "training_steps_total", run) == 5
    processes.wait_until(lambda: run not in group_runs(pgw.url, "life"), 10, what="the group deleted")
    assert time.monotonic() - closed_at >= 1.5
    assert group_runs(pgw.url, "life") == {kept}  # delete_after=None keeps it


class OutOfMemoryError(RuntimeError):
    """Named like torch.cuda.OutOfMemoryError: the alert rules read the class name."""


def test_a_run_that_dies_of_an_exception_pushes_its_class(pgw):
    """GPUMemoryLeakSuspected's fast path needs the class of the exception that ended a failed run;
    a finished run pushes none."""
    run, ok = run_id("oom"), run_id("ok")
    with pytest.raises(OutOfMemoryError):
        with TrainingMonitor(job="life", run=run, pushgateway=pgw.url, record_path=False, delete_after=None) as m:
            m.log({"loss": 0.5}, step=0)
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert pushed_value(pgw.url, "training_run_state", run, state="failed") == 1
    assert pushed_value(pgw.url, "training_run_failure_info", run, reason="OutOfMemoryError") == 1
    with TrainingMonitor(job="life", run=ok, pushgateway=pgw.url, record_path=False, delete_after=None) as m:
        m.log({"loss": 0.5}, step=0)
    assert pushed_value(pgw.url, "training_run_state", ok, state="finished") == 1
    assert pushed_value(pgw.url, "training_run_failure_info", ok) is None


def test_a_new_run_under_the_same_identity_keeps_its_group(pgw):
    run = run_id("again")
    with TrainingMonitor(job="life", run=run, pushgateway=pgw.url, record_path=False, delete_after=1.0) as m:
        m.log({"loss": 0.5}, step=0)
    deletion = next(d for key, d in push._deletions.items() if ("run", run) in key[2])
    again = TrainingMonitor(job="life", run=run, pushgateway=pgw.url, record_path=False, delete_after=0)
    try:
        deletion.thread.join(10)
        assert not deletion.thread.is_alive() and deletion.cancelled.is_set()
        wait_pushed(pgw.url, "training_run_state", run, lambda v: v == 1, state="running")
    finally:
        again.close()


def test_an_unreachable_pushgateway_schedules_no_deletion_to_wait_for():
    run = run_id("unreachable")
    with TrainingMonitor(job="life", run=run, pushgateway=f"http://127.0.0.1:{processes.free_port()}",
                         record_path=False, push_timeout=1) as m:
        m.log({"loss": 0.5}, step=0)
    assert not any(("run", run) in key[2] for key in push._deletions)


@pytest.mark.parametrize("env, argument, expected", [
    ("none", 30.0, None), ("2.5", 30.0, 2.5), ("0", 30.0, 0.0), ("2.5", 5.0, 5.0), (None, None, None),
])
def test_delete_after_setting(monkeypatch, env, argument, expected):
    if env is None:
        monkeypatch.delenv(ENV_DELETE_AFTER, raising=False)
    else:
        monkeypatch.setenv(ENV_DELETE_AFTER, env)
    with TrainingMonitor(job="life", pushgateway=False, record_path=False, delete_after=argument) as m:
        assert m.settings.delete_after == expected


@pytest.mark.parametrize("env, argument, message", [
    ("soon", 30.0, "$DUALTRACK_DELETE_AFTER must be a number of seconds >= 0 or None, got 'soon'"),
    (None, -1, "delete_after must be a number of seconds >= 0 or None, got -1"),
    (None, float("inf"), "delete_after must be"),
])
def test_bad_delete_after_is_one_clear_error(monkeypatch, env, argument, message):
    monkeypatch.delenv(ENV_DELETE_AFTER, raising=False)
    if env:
        monkeypatch.setenv(ENV_DELETE_AFTER, env)
    with pytest.raises(ValueError, match="^" + message.replace("$", r"\$").replace("(", r"\(")):
        TrainingMonitor(job="life", pushgateway=False, record_path=False, delete_after=argument)


SCRIPT = """
import sys
from trainer_hook import TrainingMonitor
url, run, mode, delete_after = sys.argv[1:5]
monitor = TrainingMonitor(job="life", run=run, pushgateway=url, record_path=False, delete_after=float(delete_after))
for step in range(10):
    monitor.log({"loss": 0.5}, step=step)
print("ready", flush=True)
if mode == "wait":
    sys.stdin.read()
if mode == "interrupt":
    with monitor:
        raise KeyboardInterrupt  # Ctrl-C in the training loop
"""


def test_process_exit_waits_for_the_deletion_and_sigterm_or_ctrl_c_does_not(pgw):
    """A script that ends after training waits (at most delete_after) and leaves nothing behind; one
    stopped by SIGTERM or Ctrl-C exits at once and leaves its failed state to the janitor."""
    run = run_id("exit")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", SCRIPT, pgw.url, run, "exit", "1.5"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert run not in group_runs(pgw.url, "life")
    assert time.monotonic() - started >= 1.5

    run = run_id("sigterm")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, pgw.url, run, "wait", "30"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
        assert time.monotonic() - signalled < 15  # not the 30 s of delete_after
    finally:
        proc.kill()
    assert pushed_value(pgw.url, "training_run_state", run, state="failed") == 1

    run = run_id("ctrl-c")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, pgw.url, run, "interrupt", "30"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        interrupted = time.monotonic()
        proc.wait(30)
        assert time.monotonic() - interrupted < 15, proc.stderr.read()
    finally:
        proc.kill()
    assert pushed_value(pgw.url, "training_run_state", run, state="failed") == 1


RUNS, THREADS, DELETE_AFTER = 200, 4, 3.0


def test_two_hundred_finished_runs_leave_only_live_runs_and_all_final_values(tmp_path, start_service, pgw):
    """The figure: after 200 short runs finished, the Pushgateway serves exactly the live runs' series,
    and Prometheus holds every finished run's final state and step count."""
    config = processes.render_prometheus_config(tmp_path, {processes.PUSHGATEWAY_JOB: [pgw.address]},
                                                scrape_interval="1s", evaluation_interval="1s")
    prom = start_service(processes.prometheus(tmp_path, config))
    sweep = run_id("sweep")
    live = [TrainingMonitor(job=sweep, run=f"live-{i}", pushgateway=pgw.url, push_interval=0.5, record_path=False,
                            delete_after=0) for i in range(3)]
    for monitor in live:
        monitor.log({"loss": 1.0, "grad_norm": 0.1}, step=0)
    processes.wait_until(lambda: pushed_value(pgw.url, "training_steps_total", "live-2", job=sweep) == 1, 10,
                         what="the live runs pushed")
    live_series = series_count(pgw.url, sweep)
    daemons.wait_for_series(prom.url, f'training_steps_total{{job="{sweep}"}}', 30)  # Prometheus scrapes

    def steps(i: int) -> int:
        return 3 + i % 7

    def train(worker: int) -> None:
        for i in range(worker, RUNS, THREADS):
            with TrainingMonitor(job=sweep, run=f"r{i:03d}", pushgateway=pgw.url, push_interval=0.2,
                                 record_path=False, delete_after=DELETE_AFTER) as monitor:
                for step in range(steps(i)):
                    monitor.log({"loss": 1.0 / (step + 1), "grad_norm": 0.1}, step=step)

    started = time.monotonic()
    workers = [threading.Thread(target=train, args=(w,)) for w in range(THREADS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    trained = time.monotonic() - started
    try:
        processes.wait_until(lambda: group_runs(pgw.url, sweep) == {"live-0", "live-1", "live-2"}, 60,
                             interval=0.5, what="only the live runs left on the Pushgateway")
        emptied = time.monotonic() - started
        assert series_count(pgw.url, sweep) == live_series
        final = daemons.query(prom.url, f'last_over_time(training_steps_total{{job="{sweep}",run=~"r.*"}}[10m])')
        assert {r["metric"]["run"]: float(r["value"][1]) for r in final} == \
            {f"r{i:03d}": steps(i) for i in range(RUNS)}
        finished = daemons.query(prom.url, f'count(last_over_time(training_run_state'
                                           f'{{job="{sweep}",run=~"r.*",state="finished"}}[10m]) == 1)')
        assert float(finished[0]["value"][1]) == RUNS
    finally:
        for monitor in live:
            monitor.close()
    print(f"{RUNS} runs in {THREADS} threads trained in {trained:.1f} s; Pushgateway back to the "
          f"{live_series} series of 3 live runs {emptied:.1f} s after the start (delete_after {DELETE_AFTER:g} s)")


def test_a_restarted_pushgateway_keeps_the_live_runs_last_values(tmp_path, start_service):
    pgw = start_service(processes.pushgateway(tmp_path, persistence=True))
    run = run_id("persist")
    monitor = TrainingMonitor(job="life", run=run, pushgateway=pgw.url, push_interval=3600, record_path=False,
                              delete_after=0)
    try:  # its first push (state running, start time), then nothing for an hour
        started = wait_pushed(pgw.url, "training_start_timestamp_seconds", run, lambda v: v > 0)
        pgw.restart()  # SIGTERM: the Pushgateway writes its persistence file; then it starts again
        assert pushed_value(pgw.url, "training_start_timestamp_seconds", run) == started
        assert pushed_value(pgw.url, "training_run_state", run, state="running") == 1
    finally:
        monitor.close()
