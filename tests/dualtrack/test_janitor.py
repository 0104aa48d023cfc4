"""`dualtrack janitor` against a real Pushgateway: deletes only dualtrack runs that are over, never a
live run or another job's group; survives an unreachable Pushgateway and malformed groups."""
from __future__ import annotations

import base64
import json
import logging
import subprocess
import sys
import time

import pytest
import requests
import yaml

from dualtrack import cli
from stack import processes
from tests.support.certs import PASSWORD, USER
from tests.support.hook import http_gateway, run_id
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.e2e


def groups(pushgateway_url: str) -> list[dict[str, str]]:
    data = requests.get(pushgateway_url + "/api/v1/metrics", timeout=5).json()["data"]
    return [group["labels"] for group in data]


def runs(pushgateway_url: str) -> set[str]:
    return {labels.get("run", labels["job"]) for labels in groups(pushgateway_url)}


def janitor(pushgateway_url: str, *args: str) -> int:
    return cli.main(["janitor", f"--pushgateway={pushgateway_url}", "--once", *args])


@pytest.fixture
def pgw(tmp_path, start_service):
    return start_service(processes.pushgateway(tmp_path))


def test_deletes_only_dualtrack_runs_older_than_their_retention(pgw):
    finished, dead, live = run_id("finished"), run_id("dead"), run_id("live")
    with TrainingMonitor(job="jan", run=finished, pushgateway=pgw.url, record_path=False, delete_after=None) as m:
        m.log({"loss": 1.0}, step=0)
    # Killed without a word: it pushed "running" once and never again (closed, and deleted at once,
    # only when the test is over).
    dead_run = TrainingMonitor(job="jan", run=dead, pushgateway=pgw.url, push_interval=3600, record_path=False,
                               delete_after=0)
    dead_run.log({"loss": 1.0}, step=0)
    live_run = TrainingMonitor(job="jan", run=live, pushgateway=pgw.url, push_interval=0.2, record_path=False,
                               delete_after=0)
    # Other jobs' groups: a batch job, and one with run/rank labels but without dualtrack's metrics.
    for path in ("/metrics/job/nightly-backup", f"/metrics/job/jan/run/{run_id('foreign')}/rank/0"):
        requests.put(pgw.url + path, data="backup_last_success_timestamp_seconds 1\n", timeout=5).raise_for_status()
    try:
        processes.wait_until(lambda: len(groups(pgw.url)) == 5, 10, what="5 groups")
        before = runs(pgw.url)
        # Nothing is old enough yet.
        assert janitor(pgw.url, "--finished-retention=1m", "--retention=1h") == 0
        assert runs(pgw.url) == before
        # Finished runs first (short retention), then runs still marked running that stopped pushing.
        processes.wait_until(lambda: janitor(pgw.url, "--finished-retention=0.5s", "--retention=1h") == 0
                             and finished not in runs(pgw.url), 10, what="the finished run deleted")
        assert runs(pgw.url) == before - {finished}
        processes.wait_until(lambda: janitor(pgw.url, "--finished-retention=0.5s", "--retention=2s") == 0
                             and dead not in runs(pgw.url), 15, what="the dead run deleted")
        # The live run (pushing every 0.2 s) and the other jobs' groups stay.
        assert runs(pgw.url) == before - {finished, dead}
        assert live in runs(pgw.url)
    finally:
        live_run.close()
        dead_run.close()


@pytest.mark.parametrize("skew", [11 * 60, 25 * 3600], ids=["11min-ahead", "25h-ahead"])
def test_the_janitors_own_clock_never_decides_an_age(pgw, monkeypatch, skew):
    finished, live = run_id("finished"), run_id("live")
    with TrainingMonitor(job="jan", run=finished, pushgateway=pgw.url, record_path=False, delete_after=None) as m:
        m.log({"loss": 1.0}, step=0)
    live_run = TrainingMonitor(job="jan", run=live, pushgateway=pgw.url, push_interval=0.2, record_path=False,
                               delete_after=0)
    try:
        processes.wait_until(lambda: {finished, live} <= runs(pgw.url), 10, what="both groups")
        real_time = time.time
        with monkeypatch.context() as patch:
            patch.setattr(time, "time", lambda: real_time() + skew)  # the janitor's host clock is off
            assert janitor(pgw.url, "--finished-retention=10m", "--retention=24h") == 0
        assert {finished, live} <= runs(pgw.url)  # a run that finished seconds ago and a live run stay
        processes.wait_until(lambda: janitor(pgw.url, "--finished-retention=0.5s", "--retention=24h") == 0
                             and finished not in runs(pgw.url), 10, what="the finished run deleted once due")
        assert live in runs(pgw.url)
    finally:
        live_run.close()


def test_without_a_date_header_the_newest_push_is_the_pushgateways_now(caplog):
    """A proxy that drops `Date`: ages count from the newest push listed, never from the janitor's clock."""
    def group(run: str, pushed: float) -> dict:
        return {"labels": {"job": "j", "run": run, "rank": "0"},
                "training_run_state": {"metrics": [{"labels": {"state": "finished"}, "value": "1"}]},
                "push_time_seconds": {"metrics": [{"value": str(pushed)}]}}
    listing = json.dumps({"status": "success", "data": [group("old", 1000.0), group("new", 1000.0 + 700)]}).encode()

    caplog.set_level(logging.INFO, logger="dualtrack.janitor")
    with http_gateway(lambda request: 200, listing, date=False) as url:
        assert janitor(url, "--finished-retention=10m", "--dry-run") == 0
    assert "would delete job=j rank=0 run=old (finished, last push 700s ago)" in caplog.text
    assert "run=new" not in caplog.text


def test_dry_run_deletes_nothing(pgw, caplog):
    caplog.set_level(logging.INFO, logger="dualtrack.janitor")
    run = run_id("dry")
    with TrainingMonitor(job="jan", run=run, pushgateway=pgw.url, record_path=False, delete_after=None) as m:
        m.log({"loss": 1.0}, step=0)
    processes.wait_until(lambda: janitor(pgw.url, "--finished-retention=0.1s", "--dry-run") == 0
                         and "would delete" in caplog.text, 10, what="a dry-run pass")
    assert run in runs(pgw.url) and run in caplog.text


def answering(body: bytes):
    """A loopback server answering every GET with `body` (a broken or foreign "Pushgateway")."""
    return http_gateway(lambda request: 200, body)


def test_unreachable_pushgateway_and_malformed_groups_are_logged_not_fatal(caplog):
    assert janitor(f"http://127.0.0.1:{processes.free_port()}") == 1
    assert "cannot read the groups of" in caplog.text
    with answering(b"<html>not a Pushgateway</html>") as url:
        assert janitor(url) == 1
    malformed = {"status": "success", "data": [
        "not a group",
        {"labels": {"job": "j", "run": "r1", "rank": "0"}, "training_run_state": {}},
        {"labels": {"job": "j", "run": "r2", "rank": "0"}, "training_run_state": {"metrics": []},
         "push_time_seconds": {"metrics": [{"value": "soon"}]}},
        {"labels": {"job": "other"}, "push_time_seconds": {"metrics": [{"value": "1"}]}},
        *({"labels": {"job": "j", "run": f"garbage-{value}", "rank": "0"},  # never grounds for deletion
           "training_run_state": {"metrics": [{"labels": {"state": "finished"}, "value": "1"}]},
           "push_time_seconds": {"metrics": [{"value": value}]}} for value in ("NaN", "-Inf", "0"))]}
    with answering(json.dumps(malformed).encode()) as url:
        assert janitor(url, "--retention=1s", "--finished-retention=1s") == 0
    assert caplog.text.count("skipping a malformed group") == 6
    assert "delete" not in caplog.text


def test_daemon_keeps_running_while_the_pushgateway_is_down_and_then_cleans_up(tmp_path, start_service):
    port = processes.free_port()
    jan = start_service(processes.janitor(tmp_path, f"http://127.0.0.1:{port}",
                                          ["--interval=0.3s", "--finished-retention=0.5s"]))
    processes.wait_until(lambda: "cannot read the groups" in jan.log_tail(), 30, what="the janitor's first pass")
    pgw = start_service(processes.pushgateway(tmp_path, port=port))
    run = run_id("late")
    with TrainingMonitor(job="jan", run=run, pushgateway=pgw.url, record_path=False, delete_after=None) as m:
        m.log({"loss": 1.0}, step=0)
    assert run in runs(pgw.url)
    processes.wait_until(lambda: run not in runs(pgw.url), 20, what="the janitor deleting the run")
    assert jan.running()
    assert jan.log_tail().count("cannot read the groups") == 1  # logged once per outage
    assert f"run={run} (finished, last push" in jan.log_tail()


@pytest.mark.parametrize("args, message", [
    (["--retention=soon"], "'soon' is not a duration"),
    (["--interval=0"], "--interval and --timeout must be longer than 0"),
    (["--pushgateway=ftp://h"], "must be an http(s) URL"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--pushgateway-password-file=/nonexistent/hook.password"], "'/nonexistent/hook.password': No such file"),
])
def test_bad_flags_exit_2_with_one_line(args, message):
    result = subprocess.run([sys.executable, "-m", "dualtrack", "janitor", *args], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_the_janitor_never_imports_torch():
    code = ("import sys; from dualtrack.cli import main; "
            "assert main(['janitor', '--once', '--pushgateway=http://127.0.0.1:1']) == 1; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            timeout=60)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_authenticates_with_the_hooks_environment(secure_pgw, pki, monkeypatch, caplog):
    assert janitor(secure_pgw.url, "--timeout=5s") == 1  # no credentials: refused, logged
    assert "cannot read the groups of" in caplog.text
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_USERNAME", USER)
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_PASSWORD", PASSWORD)
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_CA_FILE", str(pki.ca_cert))
    run = run_id("secure")
    with TrainingMonitor(job="jan", run=run, pushgateway=secure_pgw.url, record_path=False, delete_after=None) as m:
        m.log({"loss": 1.0}, step=0)

    def secure_runs() -> set[str]:
        data = requests.get(secure_pgw.url + "/api/v1/metrics", auth=(USER, PASSWORD), verify=str(pki.ca_cert),
                            timeout=5).json()["data"]
        return {group["labels"]["run"] for group in data}
    assert run in secure_runs()
    processes.wait_until(lambda: janitor(secure_pgw.url, "--finished-retention=0.2s") == 0
                         and run not in secure_runs(), 10, what="the janitor deleting through TLS and basic auth")


def test_the_password_can_come_from_a_file_instead_of_the_environment(secure_pgw, pki, monkeypatch, tmp_path):
    password_file = tmp_path / "hook.password"
    password_file.write_text(PASSWORD + "\n")
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_CA_FILE", str(pki.ca_cert))
    monkeypatch.delenv("DUALTRACK_PUSHGATEWAY_PASSWORD", raising=False)
    monkeypatch.delenv("DUALTRACK_PUSHGATEWAY_USERNAME", raising=False)
    assert janitor(secure_pgw.url, f"--pushgateway-password-file={password_file}") == 2  # which user?
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_USERNAME", USER)
    assert janitor(secure_pgw.url, f"--pushgateway-password-file={password_file}", "--timeout=5s") == 0


def test_pushed_label_values_are_logged_with_control_characters_escaped(pgw, caplog):
    """A run label with a newline and terminal escapes: the janitor's log line shows them escaped."""
    caplog.set_level(logging.INFO, logger="dualtrack.janitor")
    evil = "forged\n2026-01-01 INFO janitor: deleted everything\x1b[2J\r"
    encoded = base64.urlsafe_b64encode(evil.encode()).decode()
    pushed = requests.put(f"{pgw.url}/metrics/job/jan/run@base64/{encoded}/rank/0", timeout=5,
                          data="# TYPE training_run_state gauge\ntraining_run_state{state=\"finished\"} 1\n")
    assert pushed.status_code in (200, 202), pushed.text
    processes.wait_until(lambda: janitor(pgw.url, "--finished-retention=0.1s", "--dry-run") == 0
                         and "would delete" in caplog.text, 10, what="a dry-run pass")
    line = next(record.getMessage() for record in caplog.records if "would delete" in record.getMessage())
    assert "run=forged\\n2026-01-01 INFO janitor: deleted everything\\x1b[2J\\r" in line
    assert not any(char in line for char in "\n\r\x1b")


def test_ships_in_compose_and_the_pushgateway_persists_on_a_volume():
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    janitor = services["janitor"]
    assert janitor["entrypoint"][:2] == ["dualtrack", "janitor"]
    assert janitor["environment"]["DUALTRACK_PUSHGATEWAY"] == "https://pushgateway:9091"  # TLS + basic auth
    assert "--pushgateway-password-file=/etc/dualtrack/secrets/hook.password" in janitor["entrypoint"]
    store = next(arg.split("=", 1)[1] for arg in services["pushgateway"]["command"]
                 if arg.startswith("--persistence.file="))
    assert any(isinstance(volume, str) and volume.startswith("pushgateway-data:")
               and store.startswith(volume.split(":")[1] + "/") for volume in services["pushgateway"]["volumes"])


def test_once_with_dry_run_says_what_it_would_delete_or_that_nothing_is_due(pgw):
    """`dualtrack janitor --once --dry-run` as a user types it: one line even when nothing is due."""
    def once(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dualtrack", "janitor", f"--pushgateway={pgw.url}", "--once",
                               "--dry-run", *args], capture_output=True, text=True, timeout=60)
    empty = once()
    assert empty.returncode == 0 and "nothing due for deletion among 0 group(s)" in empty.stderr, empty.stderr
    run = run_id("dryonce")
    with TrainingMonitor(job="jan", run=run, pushgateway=pgw.url, record_path=False, delete_after=None) as m:
        m.log({"loss": 1.0}, step=0)
    processes.wait_until(lambda: "would delete 1 of 1 group(s)" in once("--finished-retention=0.1s").stderr, 10,
                         what="a dry-run pass that finds the finished run due")
    assert run in runs(pgw.url)
