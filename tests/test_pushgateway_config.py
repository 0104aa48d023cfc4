"""The Pushgateway is shipped configured for the ranks the README advertises (2,000 pushing every 5 s):
compose, Kubernetes and the no-Docker stack all start it without the per-push consistency check, which
makes one gateway fall behind between 250 and 500 ranks (bench/bench_pushgateway.py, docs/scaling.md)."""
from __future__ import annotations

import subprocess

import requests

from stack import processes
from tests.test_compose import services
from tests.test_kubernetes import find

FLAG = "--push.disable-consistency-check"


def test_the_flag_is_one_setting_the_installed_pushgateway_knows():
    assert processes.PUSHGATEWAY_LOAD_FLAGS == (FLAG,)
    help_text = subprocess.run([processes._binary("prometheus-pushgateway"), "--help"],  # noqa: SLF001
                               capture_output=True, text=True, timeout=30)
    assert FLAG in help_text.stdout + help_text.stderr


def test_compose_and_kubernetes_start_the_pushgateway_with_it():
    assert FLAG in services()["pushgateway"]["command"]
    container = find("Deployment", "pushgateway")["spec"]["template"]["spec"]["containers"][0]
    assert FLAG in container["args"]


def test_the_stacks_pushgateway_runs_without_the_consistency_check(tmp_path, start_service):
    """Two groups pushing one family with different types: the check answers 400 to the second; the
    shipped gateway takes it (the dualtrack hook never pushes conflicting families)."""
    pgw = start_service(processes.pushgateway(tmp_path))
    assert FLAG in pgw.argv
    for rank, kind in (("0", "gauge"), ("1", "counter")):
        body = f"# TYPE dualtrack_config_probe {kind}\ndualtrack_config_probe 1\n"
        answer = requests.put(f"{pgw.url}/metrics/job/probe/rank/{rank}", data=body, timeout=10)
        assert answer.ok, (rank, answer.status_code, answer.text)  # 202 without the check
