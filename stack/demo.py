"""The no-Docker main command: run the whole dualtrack stack on this machine with a small sweep.

Starts the exporter (real NVML when a driver answers, four simulated GPUs otherwise), Pushgateway,
Prometheus (the repo's prometheus.yml and rules, loopback targets), Alertmanager (the repo's config,
its webhook pointed at a receiver in this process that prints each alert as it fires and resolves),
Grafana when `grafana-server` is installed, and a sweep of four concurrent training runs with
different hyper-parameters, one per GPU: a healthy one, an input-bound one, one whose gradients
explode, one whose GPU memory leaks. Ctrl-C (or SIGTERM, or closing the terminal) stops everything.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import requests
import yaml

from exporter.simulated import simulated_uuid
from stack import processes
from stack.processes import REPO, Service, free_port

DEFAULT_PORTS = {"prometheus": 9090, "pushgateway": 9091, "alertmanager": 9093, "exporter": 9942,
                 "grafana": 3000}
JOB = "demo"
STEP_TIME = 0.05  # seconds per demo training step
DATA_DELAY = 0.2  # seconds the input-bound run's loader waits per batch
# The demo scrapes and evaluates every 5 s (production: 15 s) so that alerts with a history
# condition (the explosion's baseline needs 5 samples older than 2 min) can fire within minutes.
DEMO_INTERVAL = "5s"
# Alertmanager waits 5 s for a new group's other alerts (production: 10 s critical, 30 s warning; the
# demo's runs have one rank each) and sends a group's changes (a resolved alert) every 10 s
# (production: 5 min), so that RESOLVED prints within seconds of the alert leaving Alertmanager.
DEMO_GROUP_WAIT = "5s"
DEMO_GROUP_INTERVAL = "10s"
# explode-lr3e-2 reads one corrupt batch (a NaN feature) this many seconds after its start: the
# sweep's first alert, TrainingLossNonFinite, within 2 min of "up" (the explosion cannot be first:
# TrainingGradientExplosion compares with more than 2 min of the run's own history).
BAD_BATCH_AFTER = 40.0
EXPLODE_AFTER = 150.0  # default: TrainingGradientExplosion needs 2 min of the run's own history
# When the sweep's alerts print, in seconds after "dualtrack is up" (the runs start just before),
# on the 2-core development VM; the banner and README.md quote these (tests/stack/test_readme.py).
# Measured with `pytest -m slow tests/stack/test_demo.py -k time_to_first -s` (2 cores, load average 1.5-6,
# two runs): the corrupt batch's TrainingLossNonFinite 60-63 s after up, TrainingGradientExplosion
# 170-173 s, TrainingDataLoaderBottleneck 375-378 s.
# A training event's alert, from the event's time in the run (both measured 23 s): the run's start-up
# (torch's import) before "up", its push, a scrape, an evaluation and Alertmanager's 5 s group wait.
EXPLOSION_ALERTS_AFTER = 25
# TrainingDataLoaderBottleneck: `for: 4m` after the 5-min data-wait share passes 30 %, then the 5 s
# group wait.
LOADER_ALERT_AFTER = 380
# GPUMemoryLeakSuspected by design: 30 min of growth before its "rose in the first half hour"
# condition holds, then `for: 10m` and Alertmanager's 5 s group wait.
LEAK_ALERT_AFTER = 41 * 60
LEAK_MINUTES = 120  # the simulated leak fills the GPU in 2 h, so it still grows when the alert fires
TRAINING_DASHBOARD = "dualtrack-training-run"
DEFAULT_RECORDS = "dualtrack-records"  # the hook's and `dualtrack report`'s default directory
GPU_PROCESSES = "simulated-gpu-processes"  # in the workdir: which run's process each simulated GPU runs


@dataclass(frozen=True)
class SweepRun:
    """One run of the demo sweep: its name, its GPU's simulated scenario, its arguments, its story."""

    name: str
    scenario: str
    args: tuple[str, ...]
    story: str


def sweep(explode_after: float) -> list[SweepRun]:
    """The four concurrent runs; run i trains on GPU i."""
    return [
        SweepRun("healthy-lr1e-2", "healthy", ("--learning-rate", "1e-2"), "trains normally: the baseline"),
        SweepRun("inputbound-workers0", "input-bound",
                 ("--learning-rate", "1e-2", "--data-workers", "0", "--input-bound", "0:1e12",
                  "--data-delay", f"{DATA_DELAY}"), "waits for its data loader (GPU heartbeat)"),
        SweepRun("explode-lr3e-2", "healthy", ("--learning-rate", "3e-2", "--bad-batch-after", f"{BAD_BATCH_AFTER:g}",
                                               "--explode-after", f"{explode_after:g}"),
                 f"reads a corrupt batch {BAD_BATCH_AFTER:g} s after it starts; its gradients explode "
                 f"{explode_after:g} s after it starts"),
        SweepRun("leak-bs128", "memory-leak", ("--learning-rate", "1e-2", "--batch-size", "128", "--leak"),
                 "its GPU's memory climbs in steps towards OOM"),
    ]


class StopRequested(BaseException):
    """Ctrl-C, SIGTERM or SIGHUP: leave whatever the main thread is doing and stop the stack."""


def request_stop(signum: int, _frame: object) -> None:
    raise StopRequested(signal.Signals(signum).name)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def say(text: str = "") -> None:
    """Print a line. Once stdout is gone (its pipe's reader died with Ctrl-C, the terminal closed),
    later output goes to /dev/null instead of raising in the middle of the shutdown."""
    try:
        print(text, flush=True)
    except OSError:  # BrokenPipeError, or EIO from a closed terminal
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the buffered rest is flushed there, silently
        os.close(devnull)


def log(message: str) -> None:
    say(f"[{time.strftime('%H:%M:%S')}] {message}")


def elapsed(seconds: float) -> str:
    return f"+{int(seconds // 60)}m{int(seconds % 60):02d}s"


def port_for(name: str) -> int:
    """The component's documented port, or (said loudly) a free one when something listens there."""
    port = DEFAULT_PORTS[name]
    if processes.port_available(port):
        return port
    moved = free_port()
    log(f"PORT MOVED: {name} uses {moved}, not its usual {port}: something else listens on {port} "
        f"(another dualtrack still running? see `ss -ltnp 'sport = :{port}'`). "
        f"Use the URLs printed below, not :{port}.")
    return moved


def real_gpu_count() -> int:
    """How many GPUs a real NVIDIA driver reports (then the exporter reads them); 0: simulate."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: all mean "simulate"
        return 0


def commands_line(prometheus_url: str) -> str:
    """The one line to paste into another terminal that makes the printed `dualtrack ...` commands work
    as printed: this folder (where ./dualtrack-records is), the command on PATH, and this Prometheus
    for `dualtrack explain` and `dualtrack report` ($DUALTRACK_PROMETHEUS)."""
    bin_dir = Path(sys.executable).parent
    if (bin_dir / "dualtrack").is_file():
        command = f'export PATH={shlex.quote(str(bin_dir))}:"$PATH"'
    else:  # not installed as a console script (`python -m stack` from a checkout)
        python = f"PYTHONPATH={shlex.quote(str(REPO))} {shlex.quote(sys.executable)}"
        command = f'dualtrack() {{ {python} -m dualtrack "$@"; }}'
    return f"cd {shlex.quote(os.getcwd())} && {command} && export DUALTRACK_PROMETHEUS={prometheus_url}"


def alerts_page(prometheus_url: str) -> str:
    """The alerts page of the Prometheus actually started: /alerts, or /classic/alerts on builds
    without the new UI (Debian's 2.42 answers 404 on /alerts)."""
    for path in ("/alerts", "/classic/alerts"):
        try:
            if requests.get(prometheus_url + path, timeout=5).status_code == 200:
                return prometheus_url + path
        except requests.RequestException:
            pass
    return prometheus_url


class AlertPrinter:
    """Alertmanager webhook payload → one line per alert as it fires or resolves, naming the run
    (GPU alerts: the run on that GPU), the time since "dualtrack is up" and what to open: the
    Grafana dashboard, or without Grafana the Prometheus alerts page and the run's report."""

    def __init__(self, run_of_uuid: dict[str, str], runs: set[str], records: Path) -> None:
        self.run_of_uuid = run_of_uuid
        self.runs = runs  # the sweep's run names: they have a record in `records`
        self.records = records
        self.up_at = time.monotonic()  # reset when the stack is up
        self.grafana_url: str | None = None
        self.prometheus_url: str | None = None
        self.alerts_url: str | None = None

    def what_to_open(self, run: str | None) -> str:
        if self.grafana_url:
            if run is None:
                return f"the dashboard {self.grafana_url}/d/dualtrack-gpu-fleet"
            return f"the dashboard {self.grafana_url}/d/{TRAINING_DASHBOARD}?var-job={JOB}&var-run={quote(run)}"
        where = f"the Prometheus alerts page {self.alerts_url}"
        if run not in self.runs:
            return where
        lookup = ("" if self.records == Path(DEFAULT_RECORDS).resolve()
                  else f" --records {shlex.quote(str(self.records))}")
        return f"{where}, or write the run's report: dualtrack report {run}{lookup} --out {run}.html"

    def __call__(self, payload: dict) -> None:
        for alert in payload.get("alerts", []):
            labels, annotations = alert.get("labels", {}), alert.get("annotations", {})
            run = labels.get("run") or self.run_of_uuid.get(labels.get("uuid", ""))
            state = "FIRING  " if alert.get("status") == "firing" else "RESOLVED"
            log(f"{state} {labels.get('alertname')} [{labels.get('severity', '')}] "
                f"run {run or '-'} ({elapsed(time.monotonic() - self.up_at)} after up): "
                f"{annotations.get('summary', '')}\n"
                f"           open {self.what_to_open(run)}")


def render_grafana_provisioning(workdir: Path, prometheus_url: str, alertmanager_url: str,
                                scrape_interval: str) -> Path:
    """Copy grafana/provisioning pointed at this machine: the datasources at the demo's Prometheus and
    Alertmanager (plain HTTP on loopback, so without the compose stack's TLS and basic auth), the
    scrape interval, and the dashboards' path."""
    target = workdir / "grafana-provisioning"
    shutil.copytree(REPO / "grafana" / "provisioning", target)
    urls = {"prometheus": prometheus_url, "alertmanager": alertmanager_url}
    for path in (target / "datasources").glob("*.yml"):
        config = yaml.safe_load(path.read_text())
        for source in config.get("datasources", []):
            source["url"] = urls[source["type"]]
            for key in ("basicAuth", "basicAuthUser", "secureJsonData"):
                source.pop(key, None)
            settings = source.get("jsonData", {})
            settings.pop("tlsAuthWithCACert", None)
            if "timeInterval" in settings:
                settings["timeInterval"] = scrape_interval
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    for path in (target / "dashboards").glob("*.yml"):
        path.write_text(path.read_text().replace("/var/lib/grafana/dashboards", str(REPO / "dashboards")))
    return target


def grafana_binary() -> str | None:
    """grafana-server (or the newer single `grafana` binary) when installed."""
    return shutil.which("grafana-server") or shutil.which("grafana")


def grafana(binary: str, workdir: Path, provisioning: Path, port: int, password: str) -> Service:
    """Grafana (not yet started) with the rendered provisioning, data under `workdir`, on loopback."""
    homepath = next((p for p in ("/usr/share/grafana", "/usr/local/share/grafana") if Path(p).is_dir()),
                    None)
    argv = [binary] + (["server"] if binary.endswith("/grafana") else [])
    argv += [f"--homepath={homepath}"] if homepath else []
    env = {**os.environ, "GF_PATHS_PROVISIONING": str(provisioning), "GF_PATHS_DATA": str(workdir / "grafana"),
           "GF_SERVER_HTTP_ADDR": "127.0.0.1", "GF_SERVER_HTTP_PORT": str(port),
           "GF_SECURITY_ADMIN_PASSWORD": password, "GF_ANALYTICS_REPORTING_ENABLED": "false"}
    return Service("grafana", argv, port, workdir / "grafana.log", ready_path="/api/health", env=env)


def demo_alertmanager_config(workdir: Path, webhook_url: str) -> Path:
    """The repo's Alertmanager config, its webhook pointed at `webhook_url`, with the demo's group interval."""
    return processes.render_alertmanager_config(workdir, {"DUALTRACK_WEBHOOK_URL": webhook_url},
                                                group_wait=DEMO_GROUP_WAIT, group_interval=DEMO_GROUP_INTERVAL)


def record_path(records: Path, run: SweepRun) -> Path:
    """The run's record in `records`, named as the hook names it, which `dualtrack report RUN` finds."""
    return records / f"{JOB}-{run.name}-rank0.jsonl"


def training_service(workdir: Path, run: SweepRun, pushgateway_url: str, gpu_uuid: str | None,
                     cuda_device: int | None, records: Path | None = None) -> Service:
    """Run `run` of the sweep: on simulated GPU `gpu_uuid`, or on real GPU `cuda_device`; its record
    goes to `records` (default: `workdir`), its log to `workdir`."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if cuda_device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(cuda_device)
    argv = [sys.executable, "-m", "stack.demo_training", "--pushgateway", pushgateway_url, "--job", JOB,
            "--run", run.name, "--step-time", f"{STEP_TIME}", *run.args,
            "--record-path", str(record_path(records or workdir, run)),
            *(["--gpu-uuid", gpu_uuid] if gpu_uuid else [])]
    return Service(f"training {run.name}", argv, 0, workdir / f"training-{run.name}.log", ready_path=None,
                   env=env)


def list_gpu_processes(path: Path, trainings: list[Service]) -> None:
    """Simulated GPU i runs the i-th run's process (the exporter's --simulate.processes file), as
    NVML would list it: the per-process series then join their runs, with no co-tenant."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(f"{gpu} {training.proc.pid}\n" for gpu, training in enumerate(trainings)))
    partial.replace(path)  # the exporter reads it at every sample: never half written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__.splitlines()[0])
    parser.add_argument("--explode-after", type=float, default=EXPLODE_AFTER, metavar="SECONDS",
                        help="when the exploding run's learning rate jumps, in seconds after it starts "
                             "(default 150: TrainingGradientExplosion compares with the run's own "
                             "history older than 2 min; earlier, only TrainingLossNonFinite fires)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where data and logs go (default: a temporary directory)")
    parser.add_argument("--records", type=Path, default=Path(DEFAULT_RECORDS), metavar="DIR",
                        help=f"where the runs' records go (default: ./{DEFAULT_RECORDS}, where `dualtrack "
                             "report RUN` looks; an earlier demo's records of the same runs are appended to)")
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


def print_summary(services: dict[str, Service], prometheus_alerts: str, password: str | None,
                  workdir: Path, kept: bool, records: Path, runs: list[SweepRun], real_gpus: bool) -> None:
    say()
    log("dualtrack is up:")
    say(f"    Prometheus   {services['prometheus'].url}  (alerts: {prometheus_alerts})")
    say(f"    Alertmanager {services['alertmanager'].url}")
    say(f"    Pushgateway  {services['pushgateway'].url}")
    say(f"    Exporter     {services['exporter'].url}/metrics")
    if "grafana" in services:
        shown = "$GRAFANA_ADMIN_PASSWORD" if os.environ.get("GRAFANA_ADMIN_PASSWORD") else password
        say(f"    Grafana      {services['grafana'].url}  (admin / {shown})")
    else:
        say("    Grafana      not installed here: the dashboards are dashboards/*.json "
            "(docker compose runs Grafana with them)")
    say(f"    Work folder  {workdir} (logs and data; " + ("kept)" if kept else
        "removed when the demo stops: --workdir DIR keeps them)"))
    say(f"    Records      {records} (the runs' records, kept)")
    say("    Commands     paste this line once in another terminal; then `dualtrack explain RUN` and "
        "`dualtrack report RUN` work there:")
    say(f"                 {commands_line(services['prometheus'].url)}")
    say()
    log(f"the sweep (job {JOB}), one run per {'GPU' if real_gpus else 'simulated GPU'}:")
    for gpu, run in enumerate(runs):
        say(f"    gpu {gpu}  {run.name:20} {run.story}")
    say()


def alert_times(explode_after: float) -> dict[str, float]:
    """When the sweep's alerts are expected to print, in seconds after "dualtrack is up"."""
    times = {"TrainingLossNonFinite": min(explode_after, BAD_BATCH_AFTER) + EXPLOSION_ALERTS_AFTER,
             "TrainingDataLoaderBottleneck": LOADER_ALERT_AFTER, "GPUMemoryLeakSuspected": LEAK_ALERT_AFTER}
    if explode_after >= 140:  # the explosion's baseline needs 5 samples older than 2 min
        times["TrainingGradientExplosion"] = explode_after + EXPLOSION_ALERTS_AFTER
    return times


def about(seconds: float) -> str:
    return f"about {round(seconds / 60)} min"


def print_expectations(args: argparse.Namespace, real_gpus: bool) -> None:
    times = alert_times(args.explode_after)
    explosion = (f"TrainingGradientExplosion (its explosion) {about(times['TrainingGradientExplosion'])} after up"
                 if "TrainingGradientExplosion" in times else
                 "no TrainingGradientExplosion (its explosion comes too early: the alert needs 2 min of the "
                 "run's history)")
    log("alerts print here as they fire and resolve, timed from \"dualtrack is up\": expect "
        f"TrainingLossNonFinite (run explode-lr3e-2, a corrupt batch or its explosion) "
        f"{about(times['TrainingLossNonFinite'])} after up, {explosion}, "
        f"TrainingDataLoaderBottleneck (run inputbound-workers0) "
        f"{about(times['TrainingDataLoaderBottleneck'])} after up.")
    if real_gpus:
        log("run leak-bs128 keeps its batches on its GPU (a small staircase in CUDA allocated memory, capped); "
            "GPUMemoryLeakSuspected needs memory heading for the GPU's total, which only the simulated GPUs "
            "stage. Ctrl-C stops everything.")
        return
    leak_at = time.strftime("%H:%M", time.localtime(time.time() + times["GPUMemoryLeakSuspected"]))
    if args.duration and args.duration < LEAK_ALERT_AFTER:
        when = f"this demo stops after {args.duration:g} s, before that"
    else:
        when = f"{about(times['GPUMemoryLeakSuspected'])} after up (around {leak_at}) if you leave it running"
    log("GPUMemoryLeakSuspected (run leak-bs128) needs 30 min of rising memory by design (a staircase, "
        f"not a start-up allocation) plus 10 min of `for`: {when}. Until then the leak shows on the "
        "Training run dashboard's memory panels. Ctrl-C stops everything.")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    for signum in STOP_SIGNALS:  # also restores a SIGINT inherited as ignored (nohup, `&` in a script)
        signal.signal(signum, request_stop)
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dualtrack-"))
    workdir.mkdir(parents=True, exist_ok=True)
    kept = args.workdir is not None
    started_services: list[Service] = []
    webhook = None

    def up(service: Service) -> Service:
        started_services.append(service)
        log(f"starting {service.name}" + (f" on {service.url}" if service.port else ""))
        return service.start(timeout=60)

    try:
        gpus = real_gpu_count()
        real_gpus = gpus > 0
        runs = sweep(args.explode_after)
        uuids = [None] * len(runs) if real_gpus else [simulated_uuid(i) for i in range(len(runs))]
        records = args.records.resolve()
        records.mkdir(parents=True, exist_ok=True)
        printer = AlertPrinter({u: r.name for u, r in zip(uuids, runs) if u}, {r.name for r in runs}, records)
        webhook = processes.WebhookReceiver(on_payload=printer).start()
        exporter_args = [] if real_gpus else [
            "--simulate=" + ",".join(run.scenario for run in runs), f"--simulate.gpus={len(runs)}",
            f"--simulate.leak-minutes={LEAK_MINUTES}", f"--simulate.processes={workdir / GPU_PROCESSES}"]
        if not real_gpus:
            list_gpu_processes(workdir / GPU_PROCESSES, [])  # none until the runs start (a reused workdir's are gone)
        services = {"exporter": up(processes.exporter(workdir, exporter_args, port=port_for("exporter")))}
        log("exporter reads " + ("real GPUs through NVML" if real_gpus else
                                  "SIMULATED GPUs (no NVIDIA driver here)"))
        services["pushgateway"] = up(processes.pushgateway(workdir, port=port_for("pushgateway"), persistence=True))
        up(processes.janitor(workdir, services["pushgateway"].url))
        alertmanager_config = demo_alertmanager_config(workdir, webhook.url)
        services["alertmanager"] = up(processes.alertmanager(workdir, alertmanager_config,
                                                             port=port_for("alertmanager")))
        prometheus_port = port_for("prometheus")
        binary = grafana_binary()
        grafana_port = port_for("grafana") if binary else None
        config = processes.render_prometheus_config(
            workdir, {processes.EXPORTER_JOB: [services["exporter"].address],
                      processes.PUSHGATEWAY_JOB: [services["pushgateway"].address],
                      "prometheus": [f"127.0.0.1:{prometheus_port}"]},
            scrape_interval=DEMO_INTERVAL, evaluation_interval=DEMO_INTERVAL,
            alertmanagers=[services["alertmanager"].address],
            # The alerts' dashboard links (dashboard_url) open this Grafana.
            external_labels={processes.GRAFANA_URL_LABEL: f"http://127.0.0.1:{grafana_port}"} if binary else None)
        if args.replay:
            count = load_replayed_blocks(args.replay, workdir / "prometheus-data")
            log(f"loaded {count} replayed block(s) from {args.replay}")
        services["prometheus"] = up(processes.prometheus(workdir, config, port=prometheus_port))
        password = os.environ.get("GRAFANA_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
        provisioning = render_grafana_provisioning(workdir, services["prometheus"].url,
                                                   services["alertmanager"].url, DEMO_INTERVAL)
        if binary:
            services["grafana"] = up(grafana(binary, workdir, provisioning, grafana_port, password))
            printer.grafana_url = services["grafana"].url
        trainings = [up(training_service(workdir, run, services["pushgateway"].url, uuid,
                                         index % gpus if gpus else None, records))
                     for index, (run, uuid) in enumerate(zip(runs, uuids))]
        if not real_gpus:
            list_gpu_processes(workdir / GPU_PROCESSES, trainings)
        printer.prometheus_url = services["prometheus"].url
        printer.alerts_url = alerts_page(printer.prometheus_url)
        print_summary(services, printer.alerts_url, password, workdir, kept, records, runs, real_gpus)
        printer.up_at = time.monotonic()
        print_expectations(args, real_gpus)
        ended: set[str] = set()
        while not args.duration or time.monotonic() - started < args.duration:
            time.sleep(1.0)
            for service in started_services:
                if service.running() or service.name in ended:
                    continue
                ended.add(service.name)
                log(f"{service.name} exited unexpectedly (code {service.proc.returncode}); its log:\n"
                    f"{service.log_tail()}")
                if service.port:  # a daemon: the stack is broken; a training run: the others go on
                    return 1
    except StopRequested as stop:
        log(f"{stop} received")
    finally:
        for signum in STOP_SIGNALS:  # a second Ctrl-C must not cut the shutdown short
            signal.signal(signum, signal.SIG_IGN)
        log("stopping")
        for service in reversed(started_services):  # the training runs first
            service.stop()
        if webhook:
            webhook.stop()
        if kept:
            log(f"kept the work folder {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            log(f"removed the work folder {workdir} (--workdir DIR keeps it)")
        log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
