"""A co-tenant in another uid's container, found with the rights the shipped deployments give the exporter.

Real processes, each in a PID namespace of its own (`unshare --pid`) and run by its own user with
`setpriv` (as containers are): three ranks of a run (rank 0 root with Docker's default capabilities,
ranks 1 and 2 uid 3000) and a neighbour of uid 4000 on rank 2's GPU. Each reports what the hook
reports of itself (trainer_hook.identity). The real exporter, run with compose's rights (uid 0 with
CAP_SYSLOG alone) and Kubernetes' (uid 10001, no capability), names the GPU processes its simulated
NVML lists; it may read none of their PID namespaces. What it served, joined with what the processes
reported, is backfilled as a run whose every rank is 25 % slower from the neighbour's arrival; a real
Prometheus with the repo's rules and `dualtrack explain` must name the neighbour, and never a rank.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from dualtrack.cli import main
from stack import processes
from stack.processes import wait_until
from tests.support import daemons
from tests.support import explain as support
from tests.support.daemons import evaluated_since
from tests.support.explain import infra_cause_rule
from tests.support.hook import run_id
from tests.support.namespaces import TRAIN, live_stack
from tests.support.paths import REPO
from tests.support.process import children

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"),
                                 reason="starts processes as other users in PID namespaces: needs root, setpriv, "
                                        "unshare")]


def user(uid: int) -> list[str]:
    """setpriv's arguments for uid (and gid) `uid` with no capability."""
    return [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]


#: Docker's default capabilities: a root container's process holds them, the compose exporter does not.
DOCKER_CAPABILITIES = ("chown,dac_override,fowner,fsetid,kill,setgid,setuid,setpcap,net_bind_service,net_raw,"
                       "sys_chroot,mknod,audit_write,setfcap")
#: The exporter's rights in each shipped deployment (docker-compose.yml; deploy/kubernetes).
DEPLOYMENTS = {"compose": ["--inh-caps=-all", "--bounding-set=-all,+syslog"],
               "kubernetes": user(10001)}
#: Who runs each process in its container, and the GPU it uses.
CONTAINERS = {"rank0": (0, ["--inh-caps=-all", f"--bounding-set=-all,+{DOCKER_CAPABILITIES.replace(',', ',+')}"]),
              "rank1": (1, user(3000)), "rank2": (2, user(3000)), "co-tenant": (2, user(4000))}
#: Names itself argv[2] (prctl PR_SET_NAME), prints what the hook reports of it, waits for stdin to close.
REPORT = """import ctypes, json, os, sys
sys.path.insert(0, sys.argv[1])
from trainer_hook.identity import own_pid_namespace, own_start_time
ctypes.CDLL(None).prctl(15, sys.argv[2].encode(), 0, 0, 0)
print(json.dumps({"pid": str(os.getpid()), "pid_namespace": own_pid_namespace(), "start_time": own_start_time()}),
      flush=True)
sys.stdin.read()
"""
PROCESS = "nvml_gpu_process_memory_used_bytes"


@pytest.fixture
def readable():
    """A directory every user may read, holding the hook's identity module (a checkout may be 0700)."""
    path = Path(tempfile.mkdtemp(prefix="dualtrack-rights-"))
    path.chmod(0o755)
    (path / "trainer_hook").mkdir()
    for name in ("__init__.py", "identity.py"):
        shutil.copy(REPO / "trainer_hook" / name, path / "trainer_hook" / name)
    os.chmod(path / "trainer_hook", 0o755)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def containers(readable):
    """Start every process of CONTAINERS; yields {name: (host pid, what it reported)}."""
    started: list[subprocess.Popen] = []
    found = {}
    python = os.path.join(sys.base_exec_prefix, "bin", "python3")
    for name, (_, rights) in CONTAINERS.items():
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "setpriv", *rights, "--",
                python, "-I", "-c", REPORT, str(readable), "stress-ng" if name == "co-tenant" else "python3"]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=readable)
        started.append(proc)
        line = proc.stdout.readline()
        assert line, f"{name} exited before it reported"
        [host_pid] = wait_until(lambda proc=proc: children(proc.pid), 10, what=f"the process unshare forked for {name}")
        found[name] = (host_pid, json.loads(line))
    yield found
    for proc in started:
        proc.stdin.close()
        proc.wait(10)


def served_processes(url: str) -> dict[str, dict[str, str]]:
    text = requests.get(url + "/metrics", timeout=5).text
    return {s.labels["pid"]: s.labels for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == PROCESS}


def exporter_labels(deployment: str, tmp_path: Path, readable: Path, start_service,
                    containers: dict) -> dict[str, dict[str, str]]:
    """The labels the exporter, run with `deployment`'s rights, serves for each process in `containers`."""
    listing = readable / "gpu-processes"  # NVML's answer: the processes' host PIDs (the exporter has pid: host)
    listing.write_text("".join(f"{CONTAINERS[name][0]} {pid}\n" for name, (pid, _) in containers.items()))
    listing.chmod(0o644)
    service = processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=3", "--sample-interval=0.2",
                                            f"--simulate.processes={listing}"])
    service.argv[:0] = ["setpriv", *DEPLOYMENTS[deployment], "--"]
    exporter = start_service(service)
    pids = {str(pid): name for name, (pid, _) in containers.items()}
    served = wait_until(lambda: (found := served_processes(exporter.url)).keys() >= pids.keys() and found, 30,
                        what=f"every process served by the {deployment} exporter")
    exporter.stop()
    return {name: served[pid] for pid, name in pids.items()}


def identities(seen: dict[str, dict[str, str]], reported: dict[str, dict]):
    """explain_support's identities of the run: each rank's process as its hook reported it and as
    the exporter served it, and the neighbour on rank 2's GPU."""
    process_labels = ("pid", "process", "container_id", "pod_uid", "slurm_job_id", "pid_namespace", "namespace_pid",
                      "start_time")

    def exporter(name: str) -> str:
        return ",".join(f'{label}="{seen[name][label]}"' for label in process_labels)

    def named(rank: int) -> dict[str, support.Identity]:
        hook = reported[f"rank{rank}"]
        return {"rank": support.Identity(",".join(f'{k}="{v}"' for k, v in hook.items()), exporter(f"rank{rank}")),
                "co-tenant": support.Identity("", exporter("co-tenant"))}
    return named


def test_a_co_tenant_in_another_uids_container_is_named_with_the_deployments_rights(tmp_path, readable, containers,
                                                                                     start_service, capsys):
    check = subprocess.run(["setpriv", *DEPLOYMENTS["kubernetes"], "--", sys.executable, "-c", "import exporter"],
                           cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    if check.returncode:
        pytest.skip("uid 10001 cannot run the exporter from this checkout (not readable by other users)")
    reported = {name: info for name, (_, info) in containers.items()}
    assert {info["pid"] for info in reported.values()} == {"1"}  # each its container's init: the PID alone is no name
    seen = {deployment: exporter_labels(deployment, tmp_path, readable, start_service, containers)
            for deployment in DEPLOYMENTS}
    for deployment, labels in seen.items():
        for name, served in labels.items():
            # no ptrace rights on any of them: the PID namespace is unknown, NSpid and the start time are read
            assert (served["pid_namespace"], served["namespace_pid"], served["start_time"]) == \
                ("", "1", reported[name]["start_time"]), (deployment, name)
        assert labels["co-tenant"]["process"] == "stress-ng"

    base = (time.time() // 3600 - 3) * 3600
    runs = dict.fromkeys(DEPLOYMENTS, "co-tenant-uid")
    support.backfill(runs, base, tmp_path / "prometheus-data", tmp_path, ranks=3,
                     identities={deployment: identities(seen[deployment], reported) for deployment in DEPLOYMENTS})
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1h}\n")
    prometheus = start_service(processes.prometheus(tmp_path, config))
    for deployment in DEPLOYMENTS:
        code = main(["explain", deployment, "--prometheus", prometheus.url, "--since", str(base),
                     "--until", str(base + 3700), "--json"])
        out = capsys.readouterr()
        assert code == 0, out.err
        (event,) = json.loads(out.out)["events"]
        assert event["kind"] == "step_time_regression" and event["rank"] is None
        top = event["causes"][0]
        co_tenant_pid = seen[deployment]["co-tenant"]["pid"]
        assert top["kind"] == "co_tenant", event
        assert top["evidence"].startswith(f"process stress-ng (pid {co_tenant_pid}) of no run on "
                                          f"{support.uuid_of(deployment, 2)}, 14.0 GiB"), top["evidence"]
        scored = {s["metric"]["rank"]: s["metric"]["cause"]
                  for s in daemons.query(prometheus.url, infra_cause_rule(), at=event["time"] + 60)
                  if s["metric"]["run"] == deployment}
        assert scored == {"2": "co_tenant"}


def test_live_rules_name_a_co_tenant_in_another_uids_container_and_never_the_runs_own(tmp_path, readable,
                                                                                     containers, start_service):
    """Live: the run's rank (a real torch hook, uid 3000, a PID namespace of its own) pushes to a real
    Pushgateway; the exporter runs with Kubernetes' rights; a real Prometheus evaluates the repo's rules.
    The rank's own GPU process is never a co-tenant; uid 4000's neighbour put on its GPU is."""
    check = subprocess.run(["setpriv", *user(3000), "--", sys.executable, "-c", "import torch, trainer_hook"],
                           cwd=readable, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    if check.returncode:
        pytest.skip("uid 3000 cannot run the hook from this checkout (not readable by other users)")
    listing = readable / "gpu-processes"
    listing.write_text("")
    listing.chmod(0o644)
    pgw, prom, uuid = live_stack(tmp_path, start_service, listing, tuple(DEPLOYMENTS["kubernetes"]))
    run = run_id("uid")
    training = start_service(processes.Service(
        "training", ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "setpriv", *user(3000), "--",
                     sys.executable, "-c", TRAIN, pgw.url, run, uuid], 0, tmp_path / "training.log",
        ready_path=None, env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(readable)}))
    [trainer] = wait_until(lambda: children(training.proc.pid), 10, what="the process unshare forked")
    try:
        listing.write_text(f"0 {trainer}\n")
        daemons.wait_for_series(prom.url, f'training_process_info{{run="{run}",pid="1"}}', 60)
        daemons.wait_for_series(prom.url, f'nvml_gpu_process_memory_used_bytes{{pid="{trainer}",namespace_pid="1"}}',
                                30)
        both_seen = time.time()
        wait_until(lambda: evaluated_since(requests.get(prom.url + "/api/v1/rules", timeout=5),
                                           "dualtrack-explain.rules", both_seen), 30,
                   what="an evaluation of the explain rules with both series")
        assert daemons.query(prom.url, f'job_run_rank:training_infra_cause:score{{run="{run}"}}') == []

        neighbour, _ = containers["co-tenant"]
        listing.write_text(f"0 {trainer}\n0 {neighbour}\n")
        [cause] = daemons.wait_for_series(
            prom.url, f'job_run_rank:training_infra_cause:score{{run="{run}",cause="co_tenant"}}', 30)
        # 0.7 while it only holds memory, 0.75 from its first utilization sample (the simulator shares the work)
        assert float(cause["value"][1]) in (0.7, 0.75)
    finally:
        os.kill(trainer, signal.SIGKILL)  # unshare --fork ignores SIGTERM; it exits with its child
