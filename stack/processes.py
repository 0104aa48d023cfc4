"""Start and stop the stack's daemons on loopback: used by the no-Docker main command and the tests.

Each daemon is a real binary (Debian's `prometheus`, `prometheus-pushgateway`,
`prometheus-alertmanager`, optionally `grafana-server`) or our own exporter, started with explicit
config and data flags on a free loopback port and awaited through its readiness endpoint.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests
import yaml

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_YML = REPO / "prometheus.yml"
RULES_DIR = REPO / "rules"
CONTAINER_RULES_DIR = "/etc/prometheus/rules"  # where prometheus.yml's rule_files are: RULES_DIR, mounted
ALERTMANAGER_YML = REPO / "alertmanager" / "alertmanager.yml"
ALERTMANAGER_RENDER = REPO / "alertmanager" / "render-config.sh"
EXPORTER_JOB = "dualtrack-exporter"
PUSHGATEWAY_JOB = "pushgateway"
_CLIENT_KEYS = ("scheme", "tls_config", "basic_auth")  # how Prometheus reaches a target or an Alertmanager


class ServiceError(RuntimeError):
    """A daemon did not start or did not become ready."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_available(port: int) -> bool:
    """True when a daemon could listen on 127.0.0.1:`port` now.

    The probe sets SO_REUSEADDR as the daemons do (Go and Python servers both set it), so a port
    whose last connections sit in TIME_WAIT after a quick restart counts as available; only a
    listening socket makes it busy.
    """
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


# Signals the daemons are stopped with. An owner started with them ignored (`nohup`, `&` in a
# script, a CI job) would pass that on through fork and exec, and its daemons would outlive stop().
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _default_stop_signals() -> None:
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def _daemon_preexec(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets the default action for the stop signals and, on Linux, SIGTERM
    when `parent` dies, however it dies (even SIGKILL).

    The flag survives exec; a parent that died between fork and prctl is caught by the getppid
    check. Linux signals when the *thread* that started the child ends, so only a child of the main
    thread gets the flag: one started from another thread (a restart in the background) lives until
    `stop()`. Elsewhere the caller's own shutdown path is all there is.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return _default_stop_signals
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        _default_stop_signals()
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def wait_until(condition: Callable[[], object], timeout: float, interval: float = 0.05,
               what: str = "condition") -> object:
    """Poll `condition` until it returns something truthy; raise TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = condition()
        except Exception:  # noqa: BLE001 - a probe that errors is simply not ready yet
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Service:
    """One daemon process on a loopback port."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    ready_path: str | None = "/-/ready"  # None: a process with no HTTP endpoint, not awaited
    scheme: str = "http"
    env: dict[str, str] | None = None
    auth: tuple[str, str] | None = field(default=None, repr=False)  # basic-auth credentials for probes
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Service:
        """Start the process and wait until its readiness endpoint answers 200."""
        log = open(self.log_path, "ab")
        # A session of its own (a terminal's Ctrl-C or hang-up reaches the owner, which stops the
        # daemons in order), yet it dies with the owner if the owner is killed outright.
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     start_new_session=True, preexec_fn=_daemon_preexec(os.getpid()))
        log.close()
        if self.ready_path is None:
            return self
        try:
            wait_until(self._ready, timeout, what=f"{self.name} ready on {self.url}")
        except TimeoutError as exc:
            self.stop()
            raise ServiceError(f"{self.name} did not become ready: {exc}\n{self.log_tail()}") from exc
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServiceError(f"{self.name} exited with {self.proc.returncode}\n{self.log_tail()}")
        return requests.get(self.url + self.ready_path, timeout=1, verify=False, auth=self.auth).status_code == 200

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds. Idempotent."""
        if not self.running():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.running():
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout: float = 30.0) -> Service:
        """Stop and start again on the same port with the same arguments."""
        self.stop()
        return self.start(timeout)


def _binary(name: str) -> str:
    for directory in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin", "/usr/sbin"]:
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise ServiceError(f"{name} not found: install it (apt-get install {name})")


# Prometheus external labels the alert annotations read: where the runbooks (docs/alerts.md) and Grafana
# (the training alerts' dashboard_url) live. Both are dropped from the alerts sent to Alertmanager.
RUNBOOKS_URL_LABEL = "dualtrack_runbooks_url"
GRAFANA_URL_LABEL = "dualtrack_grafana_url"


def render_prometheus_config(workdir: Path, targets: dict[str, list[str]], *,
                             scrape_interval: str | None = None,
                             evaluation_interval: str | None = None,
                             alertmanagers: list[str] | None = None, client: dict | None = None,
                             external_labels: dict[str, str] | None = None) -> Path:
    """Write the repo's prometheus.yml with loopback targets into `workdir`.

    Everything else (jobs, honor_labels, rules, alerting) stays as in the repo file; rule file paths
    are pointed at the repo's `rules/` directory. `targets` maps a scrape job name to its targets.
    `client` (scheme, tls_config, basic_auth) replaces the repo's TLS and auth settings of every job
    and Alertmanager; without it they are removed (plain HTTP on loopback). `external_labels` are set
    over the repo's (e.g. GRAFANA_URL_LABEL: the Grafana the alerts' dashboard links open).
    """
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    labels = config["global"].setdefault("external_labels", {})
    # ${VAR} in an external label, expanded as Prometheus' expand-external-labels does (unset: empty).
    labels.update({name: re.sub(r"\$\{(\w+)\}", lambda found: os.environ.get(found.group(1), ""), value)
                   for name, value in labels.items()})
    labels.update(external_labels or {})
    if scrape_interval:
        config["global"]["scrape_interval"] = scrape_interval
    if evaluation_interval:
        config["global"]["evaluation_interval"] = evaluation_interval
    config["rule_files"] = [str(RULES_DIR / Path(pattern).relative_to(CONTAINER_RULES_DIR))
                            for pattern in config.get("rule_files", [])]
    for job in config.get("scrape_configs", []):
        if job["job_name"] in targets:
            job["static_configs"] = [{"targets": targets[job["job_name"]]}]
            job.pop("file_sd_configs", None)
    if alertmanagers is not None:
        config.setdefault("alerting", {})["alertmanagers"] = [{"static_configs": [{"targets": alertmanagers}]}]
    for endpoint in config.get("scrape_configs", []) + config.get("alerting", {}).get("alertmanagers", []):
        for key in _CLIENT_KEYS:
            endpoint.pop(key, None)
        endpoint.update(client or {})
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def render_alertmanager_config(workdir: Path, env: dict[str, str] | None = None, *,
                               group_wait: str | None = None, group_interval: str | None = None,
                               repeat_interval: str | None = None) -> Path:
    """Write the repo's alertmanager.yml into `workdir` with its webhook URLs from the environment.

    The placeholder URLs are replaced by alertmanager/render-config.sh (as in the compose service)
    from $DUALTRACK_WEBHOOK_URL / $DUALTRACK_CRITICAL_WEBHOOK_URL (`env` is added to os.environ).
    The timing arguments, for tests, override them on every route; routes, receivers and inhibition
    rules stay as in the repo file.
    """
    path = workdir / "alertmanager.yml"
    subprocess.run(["sh", str(ALERTMANAGER_RENDER), str(ALERTMANAGER_YML), str(path)],
                   env={**os.environ, **(env or {})}, check=True)
    timings = {key: value for key, value in (("group_wait", group_wait), ("group_interval", group_interval),
                                             ("repeat_interval", repeat_interval)) if value}
    if timings:
        config = yaml.safe_load(path.read_text())
        routes = [config["route"]]
        while routes:
            route = routes.pop()
            route.update(timings)
            routes.extend(route.get("routes", []))
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def with_web_config(service: Service, web_config: Path | None, auth: tuple[str, str] | None = None) -> Service:
    """`service` reading an exporter-toolkit web-config (TLS, basic auth); its probes use https and `auth`."""
    if web_config is not None:
        service.argv.append(f"--web.config.file={web_config}")
        tls = "tls_server_config" in (yaml.safe_load(web_config.read_text()) or {})
        service.scheme, service.auth = ("https" if tls else "http"), auth
    return service


def prometheus(workdir: Path, config_path: Path, port: int | None = None,
               extra_args: list[str] | None = None, web_config: Path | None = None,
               auth: tuple[str, str] | None = None) -> Service:
    """A Prometheus (not yet started) with its TSDB under `workdir`; lifecycle API enabled.

    `extra_args` are appended to the command line (e.g. --rules.alert.resend-delay=1s in tests).
    With `web_config` it serves TLS and basic auth (see with_web_config).
    """
    port = port or free_port()
    data = workdir / "prometheus-data"
    data.mkdir(parents=True, exist_ok=True)
    argv = [_binary("prometheus"), f"--config.file={config_path}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle", "--log.level=warn",
            *(extra_args or [])]
    return with_web_config(Service("prometheus", argv, port, workdir / "prometheus.log"), web_config, auth)


def pushgateway(workdir: Path, port: int | None = None, persistence: bool = False,
                web_config: Path | None = None, auth: tuple[str, str] | None = None) -> Service:
    """A Pushgateway (not yet started); with `persistence` it keeps groups across restarts."""
    port = port or free_port()
    argv = [_binary("prometheus-pushgateway"), f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn"]  # consistency check on: a conflicting push is refused, not served
    # Debian's build defaults --persistence.file to /var/lib/prometheus/pushgateway.data, which every
    # Pushgateway started here would share (and load stale groups from): always say which file.
    argv.append(f"--persistence.file={workdir / 'pushgateway.store' if persistence else ''}")
    return with_web_config(Service("pushgateway", argv, port, workdir / "pushgateway.log"), web_config, auth)


def alertmanager(workdir: Path, config_path: Path = ALERTMANAGER_YML, port: int | None = None,
                 env: dict[str, str] | None = None, web_config: Path | None = None,
                 auth: tuple[str, str] | None = None) -> Service:
    """An Alertmanager (not yet started), clustering off, data under `workdir`."""
    port = port or free_port()
    data = workdir / "alertmanager-data"
    data.mkdir(parents=True, exist_ok=True)
    argv = [_binary("prometheus-alertmanager"), f"--config.file={config_path}",
            f"--storage.path={data}", f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=", "--log.level=warn"]
    return with_web_config(Service("alertmanager", argv, port, workdir / "alertmanager.log",
                                   env={**os.environ, **(env or {})}), web_config, auth)


def janitor(workdir: Path, pushgateway_url: str, args: list[str] | None = None,
            env: dict[str, str] | None = None) -> Service:
    """`dualtrack janitor` (not yet started) on `pushgateway_url`: no HTTP endpoint, not awaited."""
    argv = [sys.executable, "-m", "dualtrack", "janitor", f"--pushgateway={pushgateway_url}", *(args or [])]
    return Service("janitor", argv, 0, workdir / "janitor.log", ready_path=None,
                   env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def exporter(workdir: Path, args: list[str], port: int | None = None,
             env: dict[str, str] | None = None, scheme: str = "http") -> Service:
    """Our exporter daemon (`python -m exporter`), not yet started, listening on loopback."""
    port = port or free_port()
    argv = [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}", *args]
    return Service("exporter", argv, port, workdir / f"exporter-{port}.log", scheme=scheme,
                   env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


class WebhookReceiver:
    """A loopback HTTP server recording the JSON bodies POSTed to it (Alertmanager's webhook).

    `url` is what goes into $DUALTRACK_WEBHOOK_URL; `notifications()` returns the payloads so far
    (each with `receiver`, `status` and `alerts`), `wait_for_alert()` waits for one alert in them.
    `on_payload`, when given, is called with each payload as it arrives (the demo prints them).
    """

    def __init__(self, port: int | None = None, on_payload: Callable[[dict], None] | None = None) -> None:
        self._payloads: list[dict] = []
        self._on_payload = on_payload
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                payload = {**json.loads(body), "received_at": time.time()}
                with receiver._lock:
                    receiver._payloads.append(payload)
                if receiver._on_payload:
                    receiver._on_payload(payload)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port or 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/alerts"

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def notifications(self) -> list[dict]:
        with self._lock:
            return list(self._payloads)

    def wait_for_alert(self, alertname: str, status: str = "firing", timeout: float = 60.0,
                       **labels: str) -> tuple[dict, dict]:
        """Wait for a notification holding alert `alertname` in `status` with `labels`.

        Returns (notification, alert)."""
        def probe() -> tuple[dict, dict] | None:
            for payload in self.notifications():
                for alert in payload.get("alerts", []):
                    if alert["labels"].get("alertname") == alertname and alert["status"] == status \
                            and all(alert["labels"].get(k) == v for k, v in labels.items()):
                        return payload, alert
            return None
        return wait_until(probe, timeout, interval=0.1, what=f"webhook: {alertname} {status} {labels}")
