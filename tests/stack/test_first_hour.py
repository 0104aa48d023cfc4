"""What a new user meets in the first hour: the two daemons mixed up (a push to Prometheus' port, a
query to the Pushgateway's) named in one line, and the demo's one printed line that makes its printed
`dualtrack` commands work in another terminal."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from stack import processes
from stack.demo import commands_line
from stack.processes import wait_until
from tests.support.hook import run_id
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor


def dualtrack(*argv: str) -> subprocess.CompletedProcess:
    """`dualtrack ARGV` as a user runs it, with no Prometheus from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUALTRACK_")}
    return subprocess.run([sys.executable, "-m", "dualtrack", *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def test_pushing_to_prometheus_says_it_is_no_pushgateway(tmp_path, start_service, caplog) -> None:
    """The hook pointed at Prometheus' port: one warning that names the likely mix-up, not a bare 404."""
    config = processes.render_prometheus_config(tmp_path, {})
    prometheus = start_service(processes.prometheus(tmp_path, config))
    with caplog.at_level(logging.WARNING, logger="trainer_hook"):
        with TrainingMonitor(job="mixup", run=run_id("mixup"), pushgateway=prometheus.url, push_interval=0.2,
                             record_path=False, delete_after=None) as monitor:
            monitor.log({"loss": 1.0}, step=1)
            wait_until(lambda: any("push to" in r.getMessage() for r in caplog.records), 30, what="a failed push")
    [warning] = [r.getMessage() for r in caplog.records if "push to" in r.getMessage()]
    assert f"{prometheus.url} answered 404, so it is no Pushgateway: is it Prometheus?" in warning, warning
    assert "\n" not in warning


def test_querying_a_pushgateway_says_it_is_no_prometheus(tmp_path, start_service) -> None:
    """`dualtrack explain` given the Pushgateway's address: one line naming the mix-up."""
    pgw = start_service(processes.pushgateway(tmp_path))
    done = dualtrack("explain", "some-run", "--prometheus", pgw.url)
    assert done.returncode != 0 and done.stderr.count("\n") == 1, done.stderr
    assert f"{pgw.url} answered 404, so it is no Prometheus: is it a Pushgateway?" in done.stderr


def test_explain_without_a_prometheus_suggests_the_variable() -> None:
    done = dualtrack("explain", "some-run")
    assert done.returncode == 2 and "DUALTRACK_PROMETHEUS" in done.stderr and done.stderr.count("\n") == 1


def test_the_demos_one_line_makes_its_printed_commands_work(tmp_path) -> None:
    """Pasted into a fresh shell anywhere, the line the demo prints puts `dualtrack` on PATH and sets
    DUALTRACK_PROMETHEUS, so `dualtrack ...` as the alert lines print it runs."""
    line = commands_line("http://127.0.0.1:9090")
    script = f'{line} && dualtrack replay --help >/dev/null && echo "$DUALTRACK_PROMETHEUS"'
    done = subprocess.run(["bash", "-c", script],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "http://127.0.0.1:9090"
