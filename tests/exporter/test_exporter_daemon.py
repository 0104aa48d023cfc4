"""The exporter daemon started as a user starts it: flags, environment, exit codes, real HTTP scrapes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pynvml
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from exporter.cli import build_parser, env_name, parse_args
from stack import processes
from tests.support import daemons
from tests.support.paths import REPO


def scrape(url: str, path: str = "/metrics") -> dict[tuple[str, tuple], float]:
    text = requests.get(url + path, timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def values(metrics: dict, name: str, **labels: str) -> list[float]:
    return [v for (metric, pairs), v in metrics.items() if metric == name and labels.items() <= dict(pairs).items()]


def run_exporter(*args: str, env: dict[str, str] | None = None, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_no_driver_exits_1_with_one_clear_line():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    result = run_exporter("--web.listen-address=127.0.0.1:0")
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "NVML" in line and "driver" in line


@pytest.mark.parametrize("args, env", [
    (["--sample-interval=0"], {}),
    (["--no-such-flag"], {}),
    (["--web.listen-address=nonsense"], {}),
    (["--simulate=sunny"], {}),
    (["--simulate=healthy", "--simulate.call-cost=-1"], {}),
    (["--web.config.file=/nonexistent/web.yml"], {}),
    ([], {"DUALTRACK_EXPORTER_SAMPLE_INTERVAL": "often"}),
    ([], {"DUALTRACK_EXPORTER_COLLECTOR_PROCESSES": "maybe"}),
])
def test_bad_flag_or_config_exits_2_with_one_line(args, env):
    result = run_exporter(*args, env=env)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("dualtrack-exporter: error:")
    assert all(name in line for name in env)  # a bad environment variable is named


def test_every_flag_has_an_environment_equivalent():
    parser = build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest not in ("help", "version")]
    assert {"--web.listen-address", "--web.telemetry-path", "--web.config.file", "--sample-interval",
            "--idle-threshold", "--log.level", "--collector.processes", "--simulate"} <= {a.option_strings[0]
                                                                                      for a in options}
    environ = {env_name("--web.listen-address"): "127.0.0.1:1234", env_name("--web.telemetry-path"): "/m",
               env_name("--sample-interval"): "0.5", env_name("--collector.processes"): "false",
               env_name("--simulate.gpus"): "8", env_name("--log.level"): "debug"}
    assert "DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS" in environ
    args = parse_args([], environ)
    assert (args.web_listen_address, args.web_telemetry_path, args.sample_interval, args.collector_processes,
            args.simulate_gpus, args.log_level) == ("127.0.0.1:1234", "/m", 0.5, False, 8, "debug")
    assert parse_args(["--sample-interval=2"], environ).sample_interval == 2  # the command line wins


def test_simulated_daemon_from_environment_serves_and_stops_cleanly(tmp_path, start_service):
    env = {"DUALTRACK_EXPORTER_SIMULATE": "healthy", "DUALTRACK_EXPORTER_SIMULATE_GPUS": "3",
           "DUALTRACK_EXPORTER_COLLECTOR_PROCESSES": "false", "DUALTRACK_EXPORTER_WEB_TELEMETRY_PATH": "/gpu-metrics",
           "DUALTRACK_EXPORTER_SAMPLE_INTERVAL": "0.2"}
    exporter = start_service(processes.exporter(tmp_path, [], env=env))
    metrics = scrape(exporter.url, "/gpu-metrics")
    assert sorted(dict(pairs)["gpu"] for (name, pairs) in metrics if name == "nvml_gpu_info") == ["0", "1", "2"]
    assert all(dict(pairs)["simulated"] == "true" for (name, pairs) in metrics if name == "nvml_gpu_info")
    assert values(metrics, "nvml_driver_info", driver_version="simulated") == [1.0]
    assert values(metrics, "nvml_gpu_process_memory_used_bytes") == []
    assert not any(n.endswith("_created") for n, _ in metrics)
    assert requests.get(exporter.url + "/-/healthy", timeout=5).status_code == 200
    exporter.proc.send_signal(signal.SIGTERM)
    assert exporter.proc.wait(10) == 0


@pytest.mark.e2e
def test_prometheus_rate_of_busy_seconds_reads_half(tmp_path, start_service):
    """A real Prometheus scraping the daemon every second: rate() over whole busy/idle periods is 0.5."""
    exporter = start_service(processes.exporter(tmp_path, ["--simulate=input-bound", "--simulate.gpus=2",
                                                           "--sample-interval=0.2"]))
    config = processes.render_prometheus_config(tmp_path, {processes.EXPORTER_JOB: [exporter.address]},
                                                scrape_interval="1s", evaluation_interval="1s")
    prometheus = start_service(processes.prometheus(tmp_path, config))
    expr = "rate(nvml_gpu_busy_seconds_total[8s])"
    daemons.wait_for_series(prometheus.url, "count(count_over_time(nvml_gpu_busy_seconds_total[8s]) >= 8)",
                              timeout=30, predicate=lambda r: r and float(r[0]["value"][1]) == 2)
    rates = [float(series["value"][1]) for series in daemons.query(prometheus.url, expr)]
    assert len(rates) == 2 and all(0.35 <= rate <= 0.65 for rate in rates), rates


def test_sigint_stops_cleanly_too(tmp_path, start_service):
    exporter = start_service(processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=1"]))
    exporter.proc.send_signal(signal.SIGINT)
    assert exporter.proc.wait(10) == 0


def test_the_daemon_loads_no_library_that_only_some_configurations_need():
    # yaml (--web.config.file), bcrypt (basic auth), statistics (and its decimal, fractions) cost RSS
    # on every exporter; they are imported where they are needed
    optional = ("yaml", "bcrypt", "statistics", "decimal")
    code = f"import sys, exporter.cli; print(' '.join(m for m in {optional!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.split() == []


def test_the_bare_daemon_listens_on_loopback_and_containers_ask_for_every_interface():
    """Nothing listens beyond loopback unless asked: the daemon's default is 127.0.0.1:9942 (what the
    README says); the image, compose and the DaemonSet, whose port is reached through the container's
    network, each pass :9942 explicitly (compose then publishes it on 127.0.0.1 by default)."""
    import re

    import yaml
    assert parse_args([], {}).web_listen_address == "127.0.0.1:9942"
    assert "dualtrack-exporter                 # serves 127.0.0.1:9942/metrics" in (REPO / "README.md").read_text()
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ENV [^\n]*(\\\n[^\n]*)*DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS=:9942", dockerfile, re.M)
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["exporter"]
    assert compose["environment"]["DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS"] == ":9942"
    assert compose["ports"] == ["${DUALTRACK_BIND:-127.0.0.1}:9942:9942"]
    daemonset = yaml.safe_load((REPO / "deploy" / "kubernetes" / "exporter-daemonset.yaml").read_text())
    container = next(c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "exporter")
    assert "--web.listen-address=:9942" in container["args"]
