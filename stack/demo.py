"""The no-Docker main command: run the whole dualtrack stack on this machine and stage the three diagnoses.

Starts the exporter (real NVML when a driver answers, simulated GPUs otherwise), Pushgateway,
Prometheus (the repo's prometheus.yml and rules, loopback targets), Alertmanager (the repo's config,
its webhook pointed at a receiver in this process that prints each alert as it fires and resolves),
Grafana when `grafana-server` is installed, and a demo training run (CUDA when present) with the hook. The run goes
through a healthy phase, an input-bound phase, a gradient explosion, while the simulated GPUs go
healthy → input-bound → memory leak. Ctrl-C stops everything.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from exporter.simulated import simulated_uuid
from stack import processes
from stack.processes import REPO, Service, free_port

DEFAULT_PORTS = {"prometheus": 9090, "pushgateway": 9091, "alertmanager": 9093, "exporter": 9942,
                 "grafana": 3000}
STEP_TIME = 0.05  # seconds per demo training step
DATA_DELAY = 0.2  # seconds the slow data loader waits per batch in the input-bound phase


def explosion_step(phase: float) -> int:
    """The step reached half-way through the third phase: healthy and input-bound phases before it."""
    return int(phase / STEP_TIME + phase / (STEP_TIME + DATA_DELAY) + phase / 2 / STEP_TIME)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def port_for(name: str) -> int:
    """The component's usual port when it is free, else any free port."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", DEFAULT_PORTS[name]))
            return DEFAULT_PORTS[name]
        except OSError:
            return free_port()


def nvml_available() -> bool:
    """True when a real NVIDIA driver answers (then the exporter reads real GPUs)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: all mean "simulate"
        return False


def print_alerts(payload: dict) -> None:
    """Alertmanager webhook payload → one line per alert as it fires or resolves."""
    for alert in payload.get("alerts", []):
        labels, annotations = alert.get("labels", {}), alert.get("annotations", {})
        state = "FIRING  " if alert.get("status") == "firing" else "RESOLVED"
        log(f"{state} {labels.get('alertname')} [{labels.get('severity', '')}] {annotations.get('summary', '')}")


def render_grafana_provisioning(workdir: Path, prometheus_url: str, alertmanager_url: str) -> Path:
    """Copy grafana/provisioning with the datasource URLs and dashboard path pointed at this machine."""
    target = workdir / "grafana-provisioning"
    shutil.copytree(REPO / "grafana" / "provisioning", target)
    for path in target.rglob("*.yml"):
        text = path.read_text()
        text = text.replace("http://prometheus:9090", prometheus_url)
        text = text.replace("http://alertmanager:9093", alertmanager_url)
        text = text.replace("/var/lib/grafana/dashboards", str(REPO / "dashboards"))
        path.write_text(text)
    return target


def grafana(workdir: Path, provisioning: Path, port: int, password: str) -> Service | None:
    binary = shutil.which("grafana-server") or shutil.which("grafana")
    if not binary:
        return None
    homepath = next((p for p in ("/usr/share/grafana", "/usr/local/share/grafana") if Path(p).is_dir()),
                    None)
    argv = [binary] + (["server"] if binary.endswith("/grafana") else [])
    argv += [f"--homepath={homepath}"] if homepath else []
    env = {**os.environ, "GF_PATHS_PROVISIONING": str(provisioning), "GF_PATHS_DATA": str(workdir / "grafana"),
           "GF_SERVER_HTTP_ADDR": "127.0.0.1", "GF_SERVER_HTTP_PORT": str(port),
           "GF_SECURITY_ADMIN_PASSWORD": password, "GF_ANALYTICS_REPORTING_ENABLED": "false"}
    return Service("grafana", argv, port, workdir / "grafana.log", ready_path="/api/health", env=env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__.splitlines()[0])
    parser.add_argument("--phase-seconds", type=float, default=480.0,
                        help="length of each demo phase: healthy, input-bound, then the memory leak with "
                             "the gradient explosion half-way (default 480: long enough for the "
                             "data-loader alert's 5 min window and 4 min `for`)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where data and logs go (default: a temporary directory)")
    parser.add_argument("--duration", type=float, default=0.0,
                        help="stop after this many seconds (default: run until Ctrl-C)")
    parser.add_argument("--replay", type=Path, default=None, metavar="DIR",
                        help="also load the TSDB blocks that `dualtrack replay RECORD... --out DIR` made "
                             "(replayed runs, labelled replayed=\"true\", next to the demo)")
    args = parser.parse_args(argv)
    if args.replay is not None and not args.replay.is_dir():
        parser.error(f"--replay {args.replay}: not a directory")
    return args


def load_replayed_blocks(source: Path, data_dir: Path) -> int:
    """Copy the TSDB blocks (directories with a meta.json) from `source` into Prometheus's data dir."""
    blocks = [block for block in source.iterdir() if (block / "meta.json").is_file()]
    data_dir.mkdir(parents=True, exist_ok=True)
    for block in blocks:
        shutil.copytree(block, data_dir / block.name, dirs_exist_ok=True)
    return len(blocks)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dualtrack-"))
    workdir.mkdir(parents=True, exist_ok=True)
    services: list[Service] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def up(service: Service) -> Service:
        services.append(service)
        log(f"starting {service.name}" + (f" on {service.url}" if service.port else ""))
        return service.start(timeout=60)

    try:
        webhook = processes.WebhookReceiver(on_payload=print_alerts).start()
        real_gpus = nvml_available()
        phase = args.phase_seconds
        exporter_args = [] if real_gpus else ["--simulate=demo", f"--simulate.phase-seconds={phase:g}"]
        exporter = up(processes.exporter(workdir, exporter_args, port=port_for("exporter")))
        log("exporter reads " + ("real GPUs through NVML" if real_gpus else
                                  "SIMULATED GPUs (no NVIDIA driver here)"))
        pushgateway = up(processes.pushgateway(workdir, port=port_for("pushgateway")))
        alertmanager_config = processes.render_alertmanager_config(workdir, {"DUALTRACK_WEBHOOK_URL": webhook.url})
        alertmanager = up(processes.alertmanager(workdir, alertmanager_config, port=port_for("alertmanager")))
        prometheus_port = port_for("prometheus")
        config = processes.render_prometheus_config(
            workdir, {processes.EXPORTER_JOB: [exporter.address], processes.PUSHGATEWAY_JOB: [pushgateway.address],
                      "prometheus": [f"127.0.0.1:{prometheus_port}"]},
            alertmanagers=[alertmanager.address])
        if args.replay:
            count = load_replayed_blocks(args.replay, workdir / "prometheus-data")
            log(f"loaded {count} replayed block(s) from {args.replay}")
        prometheus = up(processes.prometheus(workdir, config, port=prometheus_port))
        password = os.environ.get("GRAFANA_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
        provisioning = render_grafana_provisioning(workdir, prometheus.url, alertmanager.url)
        grafana_service = grafana(workdir, provisioning, port_for("grafana"), password)
        if grafana_service:
            up(grafana_service)

        up(Service(
            "training", [sys.executable, "-m", "stack.demo_training", "--pushgateway", pushgateway.url,
                         "--step-time", f"{STEP_TIME}", "--input-bound", f"{phase:g}:{2 * phase:g}",
                         "--data-delay", f"{DATA_DELAY}",
                         "--explode-at", str(explosion_step(phase)),
                         "--record-path", str(workdir / "training-record.jsonl"),
                         *([] if real_gpus else ["--gpu-uuid", simulated_uuid(0)])],
            0, workdir / "training.log", ready_path=None, env={**os.environ, "PYTHONPATH": str(REPO)}))
        print(flush=True)
        log("dualtrack is up:")
        print(f"    Prometheus   {prometheus.url}  (alerts: {prometheus.url}/alerts)")
        print(f"    Alertmanager {alertmanager.url}")
        print(f"    Pushgateway  {pushgateway.url}")
        print(f"    Exporter     {exporter.url}/metrics")
        if grafana_service:
            print(f"    Grafana      {grafana_service.url}  (admin / {'$GRAFANA_ADMIN_PASSWORD' if os.environ.get('GRAFANA_ADMIN_PASSWORD') else password})")
        else:
            print("    Grafana      not installed here: dashboards are in dashboards/ (docker compose runs Grafana)")
        print(f"    Logs and data in {workdir}")
        print(flush=True)
        log(f"timeline: healthy until {phase:g}s, input-bound until {2 * phase:g}s, then the simulated GPUs "
            f"leak memory and the run's gradients explode at step {explosion_step(phase)} "
            f"(about {2.5 * phase:g}s). Alerts print here as they fire and resolve. Ctrl-C stops.")
        started = time.monotonic()
        while not stop.wait(1.0):
            if args.duration and time.monotonic() - started > args.duration:
                break
    except KeyboardInterrupt:
        pass
    finally:
        log("stopping")
        for service in reversed(services):  # the training run first
            service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
