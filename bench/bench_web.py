"""Exporter HTTP layer benchmark: what TLS and basic auth cost a scrape, side by side in one run; or
what this tree's HTTP request parsing costs the daemon next to another revision's.

    .venv/bin/python bench/bench_web.py [--scrapes 40]
    .venv/bin/python bench/bench_web.py --against main [--minutes 5]

Default: four in-process servers on loopback with the same small registry: plain HTTP, HTTPS, HTTPS
with basic auth (bcrypt cost 10, successful checks cached, the default) and the same without the
cache. Scrapes rotate over the four (one keep-alive session each) so machine noise hits all alike;
reports median and p90 latency per server and the cache's ratio.

--against REV: two `--simulate` daemons (8 GPUs, bench_exporter's flags) at once, one from this tree's
`exporter/`, one from REV's (`git archive`), each a compiled copy in a temporary directory. Each is
scraped once a second, as Prometheus scrapes (keep-alive, gzip), the two in alternating order, for
`--minutes`; reports each one's resident memory at the end (VmRSS, and its peak VmHWM) and CPU seconds
per scrape (all of the daemon's CPU over the run, its sampler's included: what one scrape a second
costs), and the ratios this tree / REV.
"""
from __future__ import annotations

import argparse
import compileall
import http.client
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import prometheus_client
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_exporter import cpu_seconds, daemon_flags, installed_copy, start
from exporter.web import WebServer
from exporter.webconfig import load_web_config
from stack.processes import free_port
from tests.support.certs import bcrypt_hash, make_pki

PASSWORD = "bench-password"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=40, help="scrapes per server (default %(default)s)")
    parser.add_argument("--against", metavar="REV", help="compare the daemon with REV's exporter/ instead")
    parser.add_argument("--minutes", type=float, default=5.0, help="with --against: how long (default %(default)s)")
    args = parser.parse_args()
    if args.against:
        against(args.against, args.minutes)
    else:
        tls_and_auth(args.scrapes)


def tls_and_auth(scrapes: int) -> None:
    """Latency of plain HTTP, HTTPS and HTTPS with basic auth (cached or not), side by side."""
    workdir = Path(tempfile.mkdtemp(prefix="dualtrack-bench-web-"))
    pki = make_pki(workdir / "pki")
    tls = f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
    (workdir / "tls.yml").write_text(tls)
    (workdir / "auth.yml").write_text(tls + f"basic_auth_users:\n  prom: '{bcrypt_hash(PASSWORD)}'\n")

    registry = prometheus_client.CollectorRegistry()
    gauge = prometheus_client.Gauge("nvml_gpu_utilization_ratio", "bench", ["gpu", "uuid"], registry=registry)
    for gpu in range(8):
        gauge.labels(str(gpu), f"GPU-{gpu}").set(0.5)

    setups = {  # name: (web config file, auth cache, credentials)
        "http": (None, True, None),
        "https": (workdir / "tls.yml", True, None),
        "https+auth (cache)": (workdir / "auth.yml", True, ("prom", PASSWORD)),
        "https+auth (no cache)": (workdir / "auth.yml", False, ("prom", PASSWORD)),
    }
    servers, sessions, urls = [], {}, {}  # verify per request: a session's is overridden by $REQUESTS_CA_BUNDLE
    for name, (config, cache, auth) in setups.items():
        server = WebServer(registry, listen_address="127.0.0.1:0", telemetry_path="/metrics",
                           web_config=load_web_config(str(config)) if config else None, ready=lambda: True,
                           auth_cache=cache)
        server.start()
        servers.append(server)
        urls[name] = f"{'https' if config else 'http'}://127.0.0.1:{server.server_address[1]}/metrics"
        sessions[name] = requests.Session()
        sessions[name].auth = auth

    latencies: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(scrapes + 1):
        for name in setups:
            started = time.perf_counter()
            response = sessions[name].get(urls[name], timeout=10, verify=str(pki.ca_cert))
            latencies[name].append(time.perf_counter() - started)
            assert response.status_code == 200, (name, response.status_code)
    for server in servers:
        server.shutdown()

    print(f"{'server':<24}{'median ms':>10}{'p90 ms':>10}   ({scrapes} scrapes each, first dropped)")
    for name, values in latencies.items():
        values = values[1:]  # the first scrape pays the TCP/TLS handshake (and the first bcrypt check)
        p90 = statistics.quantiles(values, n=10)[8]
        print(f"{name:<24}{statistics.median(values) * 1000:>10.2f}{p90 * 1000:>10.2f}")
    ratio = statistics.median(latencies["https+auth (no cache)"][1:]) / statistics.median(
        latencies["https+auth (cache)"][1:])
    print(f"bcrypt cache: authenticated scrapes {ratio:.0f}x faster")



def status_mb(pid: int, field: str) -> float:
    """A memory figure of /proc/PID/status (VmRSS, VmHWM) in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


def revision_copy(revision: str, directory: Path) -> str:
    """`directory` with REV's `exporter/`, its bytecode compiled (as `installed_copy` does for this tree)."""
    directory.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "exporter"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive.stdout, check=True)
    if not compileall.compile_dir(directory / "exporter", quiet=1):
        sys.exit(f"bench_web: cannot compile {revision}'s exporter")
    return str(directory)


def against(revision: str, minutes: float) -> None:
    """This tree's daemon and REV's, scraped once a second each for `minutes`: memory and CPU per scrape."""
    workdir = Path(tempfile.mkdtemp(prefix="dualtrack-bench-web-"))
    copies = {"this tree": installed_copy(str(workdir / "tree")), revision: revision_copy(revision, workdir / "rev")}
    daemons = []
    try:
        for name, installed in copies.items():
            port = free_port()
            daemons.append(start(name, [sys.executable, "-m", "exporter", *daemon_flags(port, 1.0)], port, installed))
        connections = [http.client.HTTPConnection("127.0.0.1", urlsplit(url).port, timeout=30) for _, _, url in daemons]
        before = [cpu_seconds(proc.pid) for _, proc, _ in daemons]
        scrapes = int(minutes * 60)
        started = time.monotonic()
        for second in range(scrapes):
            for connection in connections[::1 if second % 2 else -1]:  # who goes first alternates
                connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
                response = connection.getresponse()
                response.read()
                assert response.status == 200, response.status
            time.sleep(max(0.0, started + second + 1 - time.monotonic()))
        figures = {name: (status_mb(proc.pid, "VmRSS"), status_mb(proc.pid, "VmHWM"),
                          (cpu_seconds(proc.pid) - cpu) / scrapes)
                   for (name, proc, _), cpu in zip(daemons, before)}
    finally:
        for _, proc, _ in daemons:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(workdir)
    print(f"{'exporter/ of':<16}{'VmRSS MB':>10}{'VmHWM MB':>10}{'CPU ms/scrape':>15}"
          f"   ({scrapes} scrapes each, one a second)")
    for name, (rss, hwm, cpu) in figures.items():
        print(f"{name:<16}{rss:>10.2f}{hwm:>10.2f}{cpu * 1000:>15.2f}")
    (rss, hwm, cpu), (base_rss, base_hwm, base_cpu) = figures.values()
    print(f"{'ratio':<16}{rss / base_rss:>10.3f}{hwm / base_hwm:>10.3f}{cpu / base_cpu:>15.3f}"
          f"   (this tree / {revision}; RSS {rss - base_rss:+.2f} MB)")


if __name__ == "__main__":
    main()
