"""A training process in a PID namespace of its own, as in a container or pod: a real torch hook
started under `unshare --pid`, pushing to a real Pushgateway; the simulated exporter's GPU runs that
process's *host* PID (what NVML reports), and the exporter reads its real /proc/<pid>/ns/pid and
NSpid; a real Prometheus evaluates the repo's rules. The GPU's process is the run's (no co_tenant
cause); a second process on that GPU, a host `sleep`, is named co_tenant by the rules and explain."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import requests

from dualtrack.explain import co_tenants
from stack import processes
from stack.processes import Service
from tests.support import daemons
from tests.support.hook import run_id
from tests.support.namespaces import TRAIN, UNSHARE, live_stack, own_namespace
from tests.support.paths import REPO
from tests.support.process import children

pytestmark = pytest.mark.e2e


def test_a_run_in_its_own_pid_namespace_owns_its_gpu_process_and_a_neighbour_is_a_co_tenant(tmp_path, start_service):
    listing = tmp_path / "gpu-processes"
    pgw, prom, uuid = live_stack(tmp_path, start_service, listing)
    run = run_id("pidns")
    training = start_service(Service("training", [*UNSHARE, sys.executable, "-c", TRAIN, pgw.url, run, uuid], 0,
                                     tmp_path / "training.log", ready_path=None,
                                     env={**os.environ, "PYTHONPATH": str(REPO)}))
    [trainer] = processes.wait_until(lambda: children(training.proc.pid), 10, what="the process unshare forked")
    try:
        check_the_join(prom.url, start_service, listing, tmp_path, run, uuid, trainer)
    finally:
        os.kill(trainer, signal.SIGKILL)  # unshare --fork ignores SIGTERM; it exits with its child


def check_the_join(prom_url: str, start_service, listing, tmp_path, run: str, uuid: str, trainer: int) -> None:
    namespace = own_namespace(trainer)
    assert namespace != own_namespace()
    listing.write_text(f"0 {trainer}\n")  # NVML: the GPU runs the trainer's host pid

    # The hook reports pid 1 in its namespace; the exporter names host pid `trainer` in that namespace.
    daemons.wait_for_series(prom_url, f'training_process_info{{run="{run}",pid="1",pid_namespace="{namespace}"}}', 60)
    daemons.wait_for_series(prom_url, f'nvml_gpu_process_memory_used_bytes{{pid="{trainer}",'
                                        f'pid_namespace="{namespace}",namespace_pid="1"}}', 30)
    both_seen = time.time()
    processes.wait_until(lambda: daemons.evaluated_since(requests.get(prom_url + "/api/v1/rules", timeout=5),
                                                         "dualtrack-explain.rules", both_seen), 30,
                         what="an evaluation of the explain rules with both series")
    assert daemons.query(prom_url, f'job_run_rank:training_infra_cause:score{{run="{run}"}}') == []
    assert daemons.query(prom_url, co_tenants(f'uuid="{uuid}"', "1m")) == []  # explain's join

    # A second process on that GPU, in the host namespace and of no run: the co-tenant.
    neighbour = start_service(Service("co-tenant", ["sleep", "600"], 0, tmp_path / "sleep.log", ready_path=None))
    listing.write_text(f"0 {trainer}\n0 {neighbour.proc.pid}\n")
    daemons.wait_for_series(prom_url, f'job_run_rank:training_infra_cause:score{{run="{run}",cause="co_tenant"}}', 30)
    named = daemons.query(prom_url, co_tenants(f'uuid="{uuid}"', "1m"))
    assert [(s["metric"]["pid"], s["metric"]["process"]) for s in named] == [(str(neighbour.proc.pid), "sleep")]
