"""The image and `docker compose up`, for real: the project's docker-compose.yml driven by a real compose
client (Debian's docker-compose) on podman, with locally built stand-ins for the upstream images
(tests/stack/containers/engine.py). Overridden: the GPU reservation (simulated GPUs instead) and Grafana,
which is left out of the run (tests/stack/containers/compose.override.yml).

Run with `pytest -m containers` (.ci/containers installs podman and the rest, as root).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import requests
import yaml

from dualtrack.prometheus import Prometheus
from exporter.simulated import simulated_uuid
from stack.processes import wait_until
from tests.stack.containers.engine import CACHE, Podman, ensure_images, missing_tools
from tests.support.paths import REPO
from trainer_hook.connection import Endpoint

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1200)]

BIND = "127.0.0.42"  # not 127.0.0.1, where the other tests and the demo publish the same ports
PROJECT = "dualtrack-ci"
SECRETS_GID = 47042  # make_secrets.py --group: the containers (nobody, uid 10001) read the 0640 secrets through it
OVERRIDE = REPO / "tests" / "stack" / "containers" / "compose.override.yml"
SERVICES = ("exporter", "pushgateway", "janitor", "prometheus", "alertmanager")  # all but Grafana
HEALTHCHECKED = ("exporter", "pushgateway", "prometheus", "alertmanager")
FIGURES = CACHE / "figures.json"
PIDNS_RUN = f"containers-pidns-{os.urandom(3).hex()}"  # the training container's run (compose.override.yml)


def _tree_copy(destination: Path) -> Path:
    """The repo's files (tracked and not ignored) in a scratch folder: the secrets made for this run go
    there, never into the user's deploy/compose/secrets."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


class Stack:
    def __init__(self, podman: Podman, tree: Path) -> None:
        self.podman = podman
        self.tree = tree
        self.secrets = tree / "deploy" / "compose" / "secrets"
        self.ca = str(self.secrets / "ca.crt")
        self.env = {**podman.env, "DUALTRACK_BIND": BIND, "COMPOSE_PROJECT_NAME": PROJECT,
                    "DUALTRACK_SECRETS_GID": str(SECRETS_GID),
                    "DUALTRACK_CI_RUN": PIDNS_RUN, "DUALTRACK_CI_GPU_UUID": simulated_uuid(0)}
        self.gpu_processes = tree / "ci-processes" / "gpu-processes"  # the exporter's --simulate.processes

    def list_gpu_processes(self, *pids: int) -> None:
        """Simulated GPU 0 runs these host PIDs (read by the exporter at every sample)."""
        partial = self.gpu_processes.with_name("gpu-processes.tmp")
        partial.write_text("".join(f"0 {pid}\n" for pid in pids))
        partial.chmod(0o644)
        partial.replace(self.gpu_processes)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(["docker-compose", "-f", "docker-compose.yml", "-f", str(OVERRIDE), *args],
                                cwd=self.tree, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode:
            raise AssertionError(f"docker-compose {' '.join(args)}: {result.stderr[-3000:]}")
        return result

    def password(self, user: str) -> str:
        return (self.secrets / f"{user}.password").read_text().strip()

    def url(self, port: int) -> str:
        return f"https://{BIND}:{port}"

    def get(self, port: int, path: str, user: str = "admin", **params) -> requests.Response:
        return requests.get(self.url(port) + path, params=params, auth=(user, self.password(user)),
                            verify=self.ca, timeout=10)

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        endpoint = Endpoint(self.url(9090), basic_auth=("admin", self.password("admin")), ca_file=str(self.ca))
        return Prometheus(endpoint, timeout=10).query(promql, at)

    def container(self, service: str) -> dict:
        ids = self.compose("ps", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return json.loads(self.podman("inspect", ids[0]).stdout)[0]

    def health(self, service: str) -> str:
        state = self.container(service)["State"]
        return (state.get("Health") or state.get("Healthcheck") or {}).get("Status", "")


def _figure(**values) -> None:
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    figures.update(values)
    FIGURES.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"containers figures: {values}", file=sys.__stderr__)


def _started_at(container: dict) -> float:
    """State.StartedAt (RFC 3339 with nanoseconds, which datetime does not parse) as a Unix time."""
    base, fraction, zone = re.match(r"(.*?T[\d:]+)(?:\.(\d+))?(.*)$", container["State"]["StartedAt"]).groups()
    zone = "+00:00" if zone in ("Z", "") else zone
    return datetime.fromisoformat(base + zone).timestamp() + float("0." + (fraction or "0"))


def _cleanup_bridge(podman: Podman, bridge: str | None) -> None:
    """netavark can leave firewall rules for a deleted bridge: delete those naming ours, only."""
    if not bridge or shutil.which("iptables-save") is None:
        return
    for table in ("filter", "nat"):
        rules = subprocess.run(["iptables-save", "-t", table], capture_output=True, text=True).stdout
        for rule in rules.splitlines():
            if rule.startswith("-A ") and f" {bridge} " in f"{rule} ":
                subprocess.run(["iptables", "-t", table, "-D", *rule.split()[1:]], capture_output=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if os.geteuid() != 0 or missing_tools():
        pytest.fail(f"needs root and {', '.join(missing_tools()) or 'nothing else'}: run .ci/containers")
    podman = Podman()
    tree = _tree_copy(tmp_path_factory.mktemp("tree"))
    subprocess.run([sys.executable, str(tree / "deploy/compose/make_secrets.py"), "--host", BIND,
                    "--group", str(SECRETS_GID)],
                   check=True, capture_output=True)
    stack = Stack(podman, tree)
    stack.gpu_processes.parent.mkdir(mode=0o755)
    stack.list_gpu_processes()  # none until the test starts its training container
    try:
        podman.start()
        podman.remove_build_leftovers()  # of a run that was killed
        started = time.monotonic()
        ensure_images(podman, log=lambda line: print(line, file=sys.__stderr__))
        _figure(base_images_s=round(time.monotonic() - started))
        stack.compose("down", "-v", "--remove-orphans", check=False)  # what a killed earlier run left
        started = time.monotonic()
        stack.compose("build", "exporter", "janitor", "training")
        _figure(image_build_s=round(time.monotonic() - started))
        ready = {}

        def watch_ready():  # the exporter's first answer on its published port, seen from the host
            def probe():
                return stack.get(9942, "/-/ready", user="prometheus").status_code == 200
            try:
                wait_until(probe, 120, interval=0.05, what="exporter ready")
                ready["at"] = time.time()
            except TimeoutError:
                pass  # reported below, with the exporter's restarts and logs
        watcher = threading.Thread(target=watch_ready, daemon=True)
        watcher.start()
        started = time.monotonic()
        stack.compose("up", "-d", *SERVICES)
        _figure(compose_up_s=round(time.monotonic() - started))
        watcher.join(120)
        if "at" not in ready:
            exporter = stack.container("exporter")
            logs = stack.podman("logs", "--tail", "5", exporter["Id"], check=False)
            raise AssertionError(f"the exporter never answered on {BIND}:9942 ({exporter['RestartCount']} restarts): "
                                 f"{(logs.stdout + logs.stderr)[-1500:]}")
        _figure(exporter_start_to_ready_s=round(ready["at"] - _started_at(stack.container("exporter")), 2))
        yield stack
    finally:
        network = podman("network", "inspect", f"{PROJECT}_default", check=False)
        bridge = json.loads(network.stdout)[0].get("network_interface") if network.returncode == 0 else None
        try:
            stack.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
            podman("network", "rm", "-f", f"{PROJECT}_default", check=False)
            podman("image", "prune", "-f", check=False)
        finally:
            podman.stop()
            podman.remove_build_leftovers()
            _cleanup_bridge(podman, bridge)


def test_image_builds_and_every_service_runs_healthy(stack):
    image = stack.container("exporter")["Image"]
    size = json.loads(stack.podman("image", "inspect", image).stdout)[0]["Size"]
    _figure(image_size_mb=round(size / 1e6))
    for service in HEALTHCHECKED:  # health checks run on their 30 s interval (podman: engine.py)
        try:
            wait_until(lambda service=service: stack.health(service) == "healthy", 150, interval=1,
                       what=f"{service} healthy")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; health-check runner errors: {stack.podman.health_errors[-3:]}") from None
    for service in SERVICES:
        assert stack.container(service)["State"]["Status"] == "running", service


def test_exporter_serves_gpu_series_over_tls_with_basic_auth(stack):
    response = stack.get(9942, "/metrics", user="prometheus")
    assert response.status_code == 200
    assert 'nvml_gpu_info{' in response.text and "nvml_gpu_utilization" in response.text
    # the kernel log (/dev/kmsg) opens with the compose file's rights: no "kernel_log_..." error
    assert 'nvml_exporter_errors_total{collector="xid"' not in response.text
    logs = stack.podman("logs", stack.container("exporter")["Id"], check=False)
    assert "cannot read the kernel log" not in logs.stdout + logs.stderr
    assert requests.get(stack.url(9942) + "/metrics", verify=stack.ca, timeout=10).status_code == 401
    with pytest.raises(requests.exceptions.SSLError):  # TLS, with the certificate of the stack's CA
        requests.get(stack.url(9942) + "/metrics", timeout=10)


def test_prometheus_scrapes_every_target_and_loads_the_rules(stack):
    def all_up():
        targets = stack.get(9090, "/api/v1/targets").json()["data"]["activeTargets"]
        jobs = {t["labels"]["job"]: t["health"] for t in targets}
        return jobs == {"dualtrack-exporter": "up", "pushgateway": "up", "prometheus": "up"} and jobs
    wait_until(all_up, 90, interval=1, what="every Prometheus target up")
    loaded = {group["name"] for group in stack.get(9090, "/api/v1/rules").json()["data"]["groups"]}
    shipped = {group["name"] for path in (REPO / "rules").rglob("*.yml")
               for group in yaml.safe_load(path.read_text())["groups"]}
    assert loaded == shipped
    assert stack.query("nvml_gpu_info")


def test_training_run_reaches_prometheus_and_a_nan_loss_alertmanager(stack, tmp_path, monkeypatch):
    from trainer_hook import TrainingMonitor

    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_USERNAME", "hook")
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_PASSWORD", stack.password("hook"))
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_CA_FILE", stack.ca)
    run = f"containers-{os.urandom(3).hex()}"
    with TrainingMonitor(job="containers-ci", run=run, pushgateway=stack.url(9091), push_interval=1,
                         record_path=tmp_path / "run.jsonl") as monitor:
        monitor.log({"loss": 0.5}, step=1)
        monitor.log({"loss": math.nan}, step=2)
        wait_until(lambda: stack.query(f'training_nonfinite_steps_total{{run="{run}"}}'), 120, interval=1,
                   what="the run's series in Prometheus")

        def alert():
            alerts = stack.get(9093, "/api/v2/alerts").json()
            return [a for a in alerts if a["labels"].get("alertname") == "TrainingLossNonFinite"
                    and a["labels"].get("run") == run]
        wait_until(alert, 180, interval=2, what="TrainingLossNonFinite in Alertmanager")
        assert monitor._pusher.failures == 0


def test_janitor_runs_and_authenticates(stack):
    assert stack.container("janitor")["State"]["Status"] == "running"
    logs = stack.compose("logs", "--no-color", "janitor").stdout
    assert "janitor: watching https://pushgateway:9091" in logs and "cannot read" not in logs, logs
    # One more pass, through the service's own entrypoint (`compose run` needs links, which podman lacks).
    entrypoint = [arg.replace("$$", "$") for arg in yaml.safe_load((stack.tree / "docker-compose.yml")
                                                                     .read_text())["services"]["janitor"]["entrypoint"]]
    once = stack.podman("exec", stack.container("janitor")["Id"], *entrypoint, "--once", check=False, timeout=120)
    assert once.returncode == 0, once.stdout + once.stderr  # 1 when the groups could not be read (401, TLS)
    assert stack.password("hook") not in once.stdout + once.stderr + logs


def test_the_janitor_and_the_exporter_run_as_different_users_without_passwords_in_their_environment(stack):
    """The exporter has the host's PID namespace: it must not share the janitor's uid, and no
    container's environment may hold a password (both read theirs from files)."""
    uids = {}
    for service in ("exporter", "janitor"):
        container = stack.container(service)
        uids[service] = stack.podman("exec", container["Id"], "id", "-u").stdout.strip()
        environment = "\n".join(container["Config"]["Env"])
        assert stack.password("hook") not in environment and stack.password("healthcheck") not in environment
        assert "PASSWORD=" not in environment, (service, environment)
    # the exporter's container starts as uid 0 (CAP_SYSLOG for the kernel log's XIDs; docker-compose.yml says
    # why), and the exporter, once /dev/kmsg is open, serves as 10001 with no capability in any thread
    assert uids == {"exporter": "0", "janitor": "10002"}
    exporter = stack.container("exporter")["State"]["Pid"]
    for status in Path(f"/proc/{exporter}/task").glob("*/status"):
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        assert fields["Uid"].split() == ["10001"] * 4 and fields["Groups"].split() == [], status
        assert all(int(fields[cap], 16) == 0 for cap in ("CapPrm", "CapEff", "CapAmb")), status


def test_a_training_container_owns_its_gpu_process_and_a_host_process_there_is_a_co_tenant(stack):
    """The training container has its own PID namespace: its hook reports pid 1 there and its start time,
    NVML the host PID. The exporter (pid: host, serving as uid 10001 with no capability, so the
    namespace link of root's container is closed to it) reads the process's PID in its namespace and its
    start time, and the rules join it to its run: no co_tenant. A host process put on that GPU (root's
    `sleep`, whose namespace link the exporter may not read: one NSpid field, the host namespace) is
    named co_tenant by the rules and by explain's query."""
    from dualtrack.explain import co_tenants
    from tests.support.daemons import evaluated_since

    stack.compose("up", "-d", "--no-deps", "training")
    trainer = stack.container("training")["State"]["Pid"]  # its PID 1, as the host numbers it
    namespace = str(os.stat(f"/proc/{trainer}/ns/pid").st_ino)
    assert namespace != str(os.stat("/proc/self/ns/pid").st_ino)
    stack.list_gpu_processes(trainer)
    uuid = simulated_uuid(0)
    started = Path(f"/proc/{trainer}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22
    joined = (f'nvml_gpu_process_memory_used_bytes{{uuid="{uuid}"}} * on (namespace_pid, start_time) group_left (run) '
              f'label_join(training_process_info{{run="{PIDNS_RUN}"}}, "namespace_pid", "", "pid")')
    [process] = wait_until(lambda: stack.query(joined), 150, interval=1,
                           what="the training's GPU process joined to its run")
    assert (process["metric"]["pid"], process["metric"]["namespace_pid"], process["metric"]["start_time"]) == (
        str(trainer), "1", started)
    seen = time.time()
    wait_until(lambda: evaluated_since(stack.get(9090, "/api/v1/rules"), "dualtrack-explain.rules", seen), 60,
               interval=1, what="an evaluation of the explain rules with the joined process")
    assert stack.query(f'job_run_rank:training_infra_cause:score{{run="{PIDNS_RUN}"}}') == []
    assert stack.query(co_tenants(f'uuid="{uuid}"', "5m")) == []

    neighbour = subprocess.Popen(["sleep", "600"])
    try:
        stack.list_gpu_processes(trainer, neighbour.pid)
        cause = f'job_run_rank:training_infra_cause:score{{run="{PIDNS_RUN}",cause="co_tenant"}}'
        wait_until(lambda: stack.query(cause), 150, interval=1,
                   what="the co_tenant cause of the training container's run")
        named = stack.query(co_tenants(f'uuid="{uuid}"', "5m"))
        assert [(s["metric"]["pid"], s["metric"]["process"]) for s in named] == [(str(neighbour.pid), "sleep")]
    finally:
        neighbour.kill()
        neighbour.wait()
        stack.list_gpu_processes()
        stack.compose("stop", "training", check=False)


def test_no_container_restarted(stack):
    for service in SERVICES:
        assert stack.container(service)["RestartCount"] == 0, service


def test_down_then_up_keeps_prometheus_data_and_pushgateway_groups(stack):
    group = "/metrics/job/containers-persist/run/kept"
    # a hook's series name: the Pushgateway job keeps training_* alone
    pushed = requests.put(stack.url(9091) + group, data="# TYPE training_step gauge\ntraining_step 42\n",
                          verify=stack.ca, auth=("hook", stack.password("hook")), timeout=10)
    assert pushed.status_code == 200, pushed.text  # accepted after the consistency check (202: unchecked)
    persisted = 'training_step{job="containers-persist"}'
    wait_until(lambda: stack.query(persisted), 60, interval=1, what="the pushed series scraped")
    before = time.time()
    stack.compose("down", timeout=300)  # no -v: the named volumes stay
    stack.compose("up", "-d", *SERVICES)
    wait_until(lambda: stack.health("prometheus") == "healthy", 150, interval=1, what="prometheus healthy again")
    groups = stack.get(9091, "/api/v1/metrics").json()["data"]
    assert any(g["labels"].get("job") == "containers-persist" for g in groups), "the Pushgateway lost its groups"
    assert stack.query(persisted, at=before), "Prometheus lost its data"
