"""The README's main command (`python -m stack`): the whole stack comes up with its sweep, the first
alert prints with the run and what to open, and however the command ends (Ctrl-C through a
pipe whose reader died, SIGHUP, SIGTERM, SIGINT inherited as ignored, the owner killed outright) no
process it started is left behind."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
import yaml

from exporter.simulated import simulated_uuid
from stack.demo import sweep
from stack.processes import wait_until
from tests.support.daemons import evaluated_since, query, wait_for_series
from tests.support.paths import REPO
from tests.support.process import alive, children, default_signal_actions

pytestmark = pytest.mark.e2e

FIRST_ALERT = re.compile(r"FIRING\s+(\w+) \[\w+\] run (\S+) \(\+(\d+)m(\d+)s after up\).*\n\s+open (.+)")


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Popen that never outlives the test: whatever is still running at teardown (a test that
    timed out or failed) is killed, and with it (PR_SET_PDEATHSIG) every daemon it started.
    The child gets the default SIGINT action (Ctrl-C kills it), even when pytest runs with SIGINT
    ignored (a background job), unless `preexec_fn` says otherwise."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("preexec_fn", default_signal_actions)
        proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, **kwargs)
        started.append(proc)
        return proc
    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def demo_argv(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "stack", "--workdir", str(workdir), "--records", str(workdir / "records"), *args]


def wait_for_output(log: Path, pattern: str, timeout: float) -> re.Match:
    return wait_until(lambda: re.search(pattern, log.read_text(errors="replace")), timeout,
                      interval=0.5, what=f"{pattern!r} in the demo's output")


def test_a_daemon_dies_with_its_owner_even_when_the_owner_is_killed(spawn, tmp_path: Path) -> None:
    owner = spawn([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from stack import processes
        daemon = processes.pushgateway(Path({str(tmp_path)!r})).start()
        print(daemon.proc.pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    daemon = int(owner.stdout.readline())
    assert alive({daemon})
    owner.send_signal(signal.SIGKILL)  # no handler, no finally: only the kernel can stop the daemon
    owner.wait(10)
    wait_until(lambda: not alive({daemon}), 15, what="the pushgateway to die with its owner")


def test_first_alert_names_the_run_and_ctrl_c_through_a_dead_pipe_stops_everything(spawn, tmp_path: Path) -> None:
    """`python -m stack | tee log`, then Ctrl-C: tee dies first, the demo's shutdown output hits a
    broken pipe, and still every daemon stops. Shortened: the run explodes 2 s after its start."""
    log = tmp_path / "demo.log"
    started = time.monotonic()
    demo = spawn(demo_argv(tmp_path / "work", "--explode-after", "2"), stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT)
    tee = spawn(["tee", str(log)], stdin=demo.stdout, stdout=subprocess.DEVNULL)
    demo.stdout.close()  # tee is the pipe's only reader
    wait_for_output(log, "dualtrack is up", 90)
    text = log.read_text()
    assert "SIMULATED GPUs" in text, text
    prometheus = re.search(r"Prometheus\s+(http://127\.0\.0\.1:\d+)", text).group(1)
    alerts_url = re.search(r"\(alerts: (http://\S+)\)", text).group(1)
    assert requests.get(alerts_url, timeout=5).status_code == 200, f"printed alerts URL {alerts_url} is broken"
    for name in ("Alertmanager", "Pushgateway", "Exporter"):
        assert re.search(rf"{name}\s+http://127\.0\.0\.1:\d+", text), f"{name} URL not printed:\n{text}"
    assert "GPUMemoryLeakSuspected" in text, "the demo says when (or that) the leak alert cannot fire"
    daemons = children(demo.pid)
    assert len(daemons) >= 8, "exporter, pushgateway, alertmanager, prometheus and four training runs"

    # Both tracks reach Prometheus: the four simulated GPUs and the four runs of the sweep.
    wait_for_series(prometheus, 'count(nvml_gpu_info{simulated="true"}) == 4', timeout=60)
    runs = wait_for_series(prometheus, 'training_step{job="demo"} > 0', timeout=90,
                           predicate=lambda result: len(result) == 4)
    assert {r["metric"]["run"] for r in runs} == {"healthy-lr1e-2", "inputbound-workers0", "explode-lr3e-2",
                                                  "leak-bs128"}
    assert query(prometheus, 'up{job="dualtrack-exporter"} == 1')
    # Simulated GPU i runs run i's process, as NVML would list it: each joins its run (the rules',
    # explain's and the run dashboard's join), and no alert reads co_tenant as its infra cause.
    joined = wait_for_series(prometheus, 'nvml_gpu_process_memory_used_bytes * on (pid_namespace, namespace_pid) '
                             'group_left (run) '
                             'label_join(training_process_info{job="demo"}, "namespace_pid", "", "pid")',
                             timeout=60, predicate=lambda result: len(result) == 4)
    assert {s["metric"]["run"]: s["metric"]["uuid"] for s in joined} == {
        run.name: simulated_uuid(gpu) for gpu, run in enumerate(sweep(2))}
    seen = time.time()
    wait_until(lambda: evaluated_since(requests.get(prometheus + "/api/v1/rules", timeout=5),
                                               "dualtrack-explain.rules", seen), 60,
               what="an evaluation of the explain rules with the joined processes")
    assert query(prometheus, 'job_run_rank:training_infra_cause:score{job="demo",cause="co_tenant"}') == []

    first = wait_for_output(log, FIRST_ALERT.pattern, 150)
    seconds = time.monotonic() - started
    print(f"first alert printed {seconds:.0f} s after the command started: {first.group(0)!r}")
    assert first.group(1) == "TrainingLossNonFinite" and first.group(2) == "explode-lr3e-2", first.group(0)
    # No Grafana here: the line names what there is to open, and its report command works.
    opened = first.group(5)
    assert opened.startswith(f"the Prometheus alerts page {alerts_url}, or write the run's report: "), opened
    # Run as printed: the summary's one line pasted into a fresh shell, then the alert line's command.
    pasted = re.search(r"Commands .*\n\s+(cd .+)\n", text).group(1)
    report = subprocess.run(["bash", "-c", f"{pasted} && {opened.split(': ', 1)[1]}"], cwd=tmp_path,
                            capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                            timeout=120)
    assert report.returncode == 0, report.stderr
    assert (REPO / "explode-lr3e-2.html").stat().st_size > 0
    (REPO / "explode-lr3e-2.html").unlink()

    tee.send_signal(signal.SIGINT)  # Ctrl-C reaches the whole pipeline: tee goes first
    tee.wait(10)
    demo.send_signal(signal.SIGINT)
    assert demo.wait(60) == 0
    wait_until(lambda: not alive(daemons), 15, what=f"the demo's processes {alive(daemons)} to stop")


@pytest.mark.parametrize("how", ["SIGHUP", "SIGTERM", "SIGINT inherited as ignored"])
def test_every_way_of_ending_the_stack_stops_its_processes(spawn, tmp_path: Path, how: str) -> None:
    log = tmp_path / "demo.log"
    ignore_sigint = signal.SIG_IGN if "ignored" in how else signal.SIG_DFL
    argv = demo_argv(tmp_path / "work")
    if how == "SIGTERM":  # the default work folder: a temporary one
        argv.remove("--workdir"), argv.remove(str(tmp_path / "work"))
    with log.open("wb") as out:
        demo = spawn(argv, stdout=out, stderr=subprocess.STDOUT,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, ignore_sigint))
    wait_for_output(log, "dualtrack is up", 90)
    daemons = children(demo.pid)
    assert len(daemons) >= 8
    demo.send_signal(getattr(signal, how.split()[0]))
    assert demo.wait(60) == 0, log.read_text()
    text = log.read_text()
    assert "stopping" in text and text.rstrip().endswith("stopped"), text[-500:]
    wait_until(lambda: not alive(daemons), 15, what=f"the demo's processes {alive(daemons)} to stop")
    # Where its work folder is, and whether it is kept: a temporary one goes, a --workdir stays.
    workdir = Path(re.search(r"Work folder\s+(\S+) \(logs and data; (kept|removed when the demo stops)", text)
                   .group(1))
    if how == "SIGTERM":
        assert "removed when the demo stops" in text and not workdir.exists()
        assert f"removed the work folder {workdir}" in text
    else:
        assert workdir == tmp_path / "work" and workdir.is_dir() and f"kept the work folder {workdir}" in text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_time_to_first_alerts_with_the_default_sweep(spawn, tmp_path: Path) -> None:
    """The README's promise on a 2-core machine, timed from "dualtrack is up" as the alert lines
    are: the first alert within 2 min, the explosion's and the data-loader alert near the times the
    banner announces (stack.demo.alert_times, which these measurements set)."""
    from stack.demo import EXPLODE_AFTER, alert_times
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        spawn(demo_argv(tmp_path / "work"), stdout=out, stderr=subprocess.STDOUT)
    first = wait_for_output(log, FIRST_ALERT.pattern, 400)
    explosion = wait_for_output(log, r"FIRING\s+TrainingGradientExplosion .*run explode-lr3e-2 "
                                     r"\(\+(\d+)m(\d+)s after up\)", 400)
    loader = wait_for_output(log, r"FIRING\s+TrainingDataLoaderBottleneck .*run inputbound-workers0 "
                                  r"\(\+(\d+)m(\d+)s after up\)", 700)
    first_at = int(first.group(3)) * 60 + int(first.group(4))
    explosion_at = int(explosion.group(1)) * 60 + int(explosion.group(2))
    loader_at = int(loader.group(1)) * 60 + int(loader.group(2))
    print(f"after up: first alert {first_at} s ({first.group(1)}), gradient explosion {explosion_at} s, "
          f"data-loader alert {loader_at} s; load average {os.getloadavg()[0]:.1f}")
    expected = alert_times(EXPLODE_AFTER)
    assert first.group(1) == "TrainingLossNonFinite" and first_at <= 120, first.group(0)
    assert explosion_at < expected["TrainingGradientExplosion"] + 60, explosion.group(0)
    assert loader_at < expected["TrainingDataLoaderBottleneck"] + 90, loader.group(0)


def test_a_port_in_time_wait_is_kept_and_a_taken_one_moves_loudly(capsys) -> None:
    """After a quick restart the documented ports sit in TIME_WAIT: the daemons (SO_REUSEADDR) can
    listen there, so the demo keeps them; a port something listens on moves, and the demo says so."""
    from stack.demo import DEFAULT_PORTS, port_for
    from stack.processes import port_available
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server side closes first: its end of the connection enters TIME_WAIT
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what a plain bind() probe saw: "in use"
    assert port_available(port)

    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            squatter.bind(("127.0.0.1", DEFAULT_PORTS["pushgateway"]))
        except OSError:
            pytest.skip("something else listens on the Pushgateway's port on this machine")
        squatter.listen()
        moved = port_for("pushgateway")
    assert moved != DEFAULT_PORTS["pushgateway"]
    assert f"PORT MOVED: pushgateway uses {moved}, not its usual 9091" in capsys.readouterr().out


def test_the_sweep_gpus_each_run_their_runs_scenario() -> None:
    """--simulate with a list gives each simulated GPU its run's story: GPU 1 beats busy/idle, GPU 3's
    memory climbs, GPUs 0 and 2 stay healthy; an unknown scenario is one line and exit 2."""
    from exporter.cli import main, parse_args
    from exporter.simulated import SimulatedNVML
    from stack.demo import sweep
    runs = sweep(150)
    args = parse_args(["--simulate=" + ",".join(run.scenario for run in runs), f"--simulate.gpus={len(runs)}"])
    workload = SimulatedNVML(args.simulate, args.simulate_gpus).workload
    assert [run.scenario for run in runs] == ["healthy", "input-bound", "healthy", "memory-leak"]
    assert {workload.utilization(1, t) for t in (0.5, 2.5)} == {0.0, 1.0}
    assert min(workload.utilization(gpu, t) for gpu in (0, 2) for t in (0.5, 2.5)) > 0.8
    assert workload.memory_used(3, 600) > workload.memory_used(3, 0)
    assert workload.memory_used(0, 600) == workload.memory_used(0, 0)
    assert main(["--simulate=healthy,melting"]) == 2


def test_a_run_the_stack_stops_ends_finished_not_failed(start_service, tmp_path: Path, monkeypatch) -> None:
    """Stopping the stack stops its runs on purpose: each pushes `finished` (not `failed`, reason
    SIGTERM) and exits at once, without waiting to delete its group (the stack's stop() would
    SIGKILL it), also with SIGINT and SIGTERM inherited as ignored."""
    from exporter.simulated import simulated_uuid
    from stack import processes
    from stack.demo import record_path, sweep, training_service
    from tests.support.hook import pushed_value, record_lines
    monkeypatch.delenv("DUALTRACK_DELETE_AFTER", raising=False)  # the default: wait at exit to delete
    pgw = start_service(processes.pushgateway(tmp_path))
    run = sweep(150)[0]
    service = training_service(tmp_path, run, pgw.url, simulated_uuid(0), None)
    service.argv += ["--push-interval", "0.5"]
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        start_service(service)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    wait_until(lambda: (pushed_value(pgw.url, "training_steps_total", run.name) or 0) > 0, 60,
               what="the run's first push")
    service.stop()
    assert service.proc.returncode == -signal.SIGTERM, service.log_tail()
    assert pushed_value(pgw.url, "training_run_state", run.name, state="finished") == 1
    assert pushed_value(pgw.url, "training_run_state", run.name, state="failed") == 0
    end = record_lines(record_path(tmp_path, run))[1][-1]
    assert end["event"] == "end" and end["state"] == "finished" and "reason" not in end, end


def test_alert_lines_say_what_to_open_with_and_without_grafana(capsys) -> None:
    """Without Grafana an alert line points at the Prometheus alerts page and the run's report
    command (there is no dashboard to open); with Grafana, at the dashboard filtered to the run."""
    from stack.demo import AlertPrinter
    printer = AlertPrinter({"GPU-0": "leak-bs128"}, {"leak-bs128"}, Path("/w/records"))
    printer.prometheus_url, printer.alerts_url = "http://127.0.0.1:9090", "http://127.0.0.1:9090/classic/alerts"
    payload = {"alerts": [{"status": "firing", "labels": {"alertname": "GPUMemoryLeakSuspected", "uuid": "GPU-0"}},
                          {"status": "firing", "labels": {"alertname": "GPUXidError", "uuid": "GPU-9"}}]}
    printer(payload)
    lines = capsys.readouterr().out
    assert "dashboard" not in lines
    assert ("open the Prometheus alerts page http://127.0.0.1:9090/classic/alerts, or write the run's report: "
            "dualtrack report leak-bs128 --records /w/records --out leak-bs128.html") in lines
    assert lines.rstrip().endswith("open the Prometheus alerts page http://127.0.0.1:9090/classic/alerts")
    printer.grafana_url = "http://127.0.0.1:3000"
    printer(payload)
    assert "open the dashboard http://127.0.0.1:3000/d/dualtrack-training-run?var-job=demo&var-run=leak-bs128" \
        in capsys.readouterr().out


def test_resolved_prints_within_seconds_of_the_alert_leaving_alertmanager(start_service, tmp_path: Path,
                                                                         capsys) -> None:
    """The demo's real Alertmanager, config and printer: an alert that resolves prints RESOLVED at the
    group's next flush (the demo's 10 s group interval), not minutes later (production's 5 min)."""
    from datetime import datetime, timedelta, timezone

    from stack import processes
    from stack.demo import AlertPrinter, demo_alertmanager_config
    printer = AlertPrinter({}, set(), tmp_path)
    printer.alerts_url = "http://127.0.0.1:9/alerts"
    webhook = processes.WebhookReceiver(on_payload=printer).start()
    try:
        am = start_service(processes.alertmanager(tmp_path, demo_alertmanager_config(tmp_path, webhook.url)))
        alert = {"labels": {"alertname": "TrainingLossNonFinite", "severity": "critical", "job": "demo",
                            "run": "explode-lr3e-2", "rank": "0", "instance": "h"}}
        soon = datetime.now(timezone.utc) + timedelta(minutes=5)
        requests.post(am.url + "/api/v2/alerts", json=[{**alert, "endsAt": soon.isoformat()}],
                      timeout=5).raise_for_status()
        webhook.wait_for_alert("TrainingLossNonFinite", timeout=60)
        requests.post(am.url + "/api/v2/alerts", json=[{**alert, "endsAt": datetime.now(timezone.utc).isoformat()}],
                      timeout=5).raise_for_status()
        webhook.wait_for_alert("TrainingLossNonFinite", status="resolved", timeout=60)
    finally:
        webhook.stop()
    assert re.search(r"RESOLVED TrainingLossNonFinite \[critical\] run explode-lr3e-2", capsys.readouterr().out)


def test_the_readmes_report_command_works_as_printed_on_a_demo_run(start_service, tmp_path: Path) -> None:
    """The README's `dualtrack report <run-id> ...`, typed where the demo ran: the demo keeps its runs'
    records where the hook and `dualtrack report` look by default (./dualtrack-records)."""
    from stack import processes
    from stack.demo import parse_args, sweep, training_service
    from tests.support.hook import pushed_value
    readme = (REPO / "README.md").read_text()
    command = re.search(r"^\.venv/bin/dualtrack report <run-id> (.+)$", readme, re.M).group(1).split()
    pgw = start_service(processes.pushgateway(tmp_path))
    run = sweep(150)[0]
    service = training_service(tmp_path, run, pgw.url, None, None, records=tmp_path / parse_args([]).records)
    service.argv += ["--push-interval", "0.5"]
    start_service(service)
    wait_until(lambda: (pushed_value(pgw.url, "training_steps_total", run.name) or 0) > 3, 60,
               what="a few steps of the demo run")
    report = subprocess.run([sys.executable, "-m", "dualtrack", "report", run.name, *command], cwd=tmp_path,
                            capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "report.html").stat().st_size > 0 and (tmp_path / "report.png").stat().st_size > 0


def test_the_demos_grafana_datasources_reach_its_prometheus_and_alertmanager(start_service, tmp_path: Path) -> None:
    """Without Grafana: the provisioned datasource files, read as Grafana reads them ($__file{} resolved,
    basic auth and the CA when they say so), answer queries from the demo's running daemons."""
    from stack import processes
    from stack.demo import DEMO_INTERVAL, render_grafana_provisioning
    am = start_service(processes.alertmanager(tmp_path, processes.render_alertmanager_config(tmp_path)))
    config = processes.render_prometheus_config(tmp_path, {"prometheus": []}, scrape_interval=DEMO_INTERVAL)
    prometheus = start_service(processes.prometheus(tmp_path, config))
    provisioning = render_grafana_provisioning(tmp_path, prometheus.url, am.url, DEMO_INTERVAL)

    def resolved(value: str) -> str:
        return re.sub(r"\$__file\{([^}]+)\}", lambda found: Path(found.group(1)).read_text().strip(), value)

    sources = {source["type"]: source for path in (provisioning / "datasources").glob("*.yml")
               for source in yaml.safe_load(path.read_text())["datasources"]}
    assert set(sources) == {"prometheus", "alertmanager"}
    paths = {"prometheus": "/api/v1/query?query=up", "alertmanager": "/api/v2/status"}
    for kind, source in sources.items():
        secure = {key: resolved(value) for key, value in source.get("secureJsonData", {}).items()}
        auth = (source["basicAuthUser"], secure["basicAuthPassword"]) if source.get("basicAuth") else None
        verify: bool | str = True
        if source.get("jsonData", {}).get("tlsAuthWithCACert"):
            verify = str(tmp_path / f"{kind}-ca.crt")
            Path(verify).write_text(secure["tlsCACert"])
        answer = requests.get(source["url"] + paths[kind], auth=auth, verify=verify, timeout=10)
        assert answer.status_code == 200, (kind, source["url"], answer.text)
    assert sources["prometheus"]["jsonData"]["timeInterval"] == DEMO_INTERVAL
