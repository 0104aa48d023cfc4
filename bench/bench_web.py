"""Exporter HTTP layer benchmark: what TLS and basic auth cost a scrape, side by side in one run.

    .venv/bin/python bench/bench_web.py [--scrapes 40]

Four in-process servers on loopback with the same small registry: plain HTTP, HTTPS, HTTPS with
basic auth (bcrypt cost 10, successful checks cached, the default) and the same without the cache.
Scrapes rotate over the four (one keep-alive session each) so machine noise hits all alike; reports
median and p90 latency per server and the cache's ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import prometheus_client
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exporter.web import WebServer  # noqa: E402
from exporter.webconfig import load_web_config  # noqa: E402
from tests.support.certs import bcrypt_hash, make_pki  # noqa: E402

PASSWORD = "bench-password"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=40, help="scrapes per server (default %(default)s)")
    args = parser.parse_args()

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
    for _ in range(args.scrapes + 1):
        for name in setups:
            started = time.perf_counter()
            response = sessions[name].get(urls[name], timeout=10, verify=str(pki.ca_cert))
            latencies[name].append(time.perf_counter() - started)
            assert response.status_code == 200, (name, response.status_code)
    for server in servers:
        server.shutdown()

    print(f"{'server':<24}{'median ms':>10}{'p90 ms':>10}   ({args.scrapes} scrapes each, first dropped)")
    for name, values in latencies.items():
        values = values[1:]  # the first scrape pays the TCP/TLS handshake (and the first bcrypt check)
        print(f"{name:<24}{statistics.median(values) * 1000:>10.2f}{statistics.quantiles(values, n=10)[8] * 1000:>10.2f}")
    ratio = statistics.median(latencies["https+auth (no cache)"][1:]) / statistics.median(latencies["https+auth (cache)"][1:])
    print(f"bcrypt cache: authenticated scrapes {ratio:.0f}x faster")


if __name__ == "__main__":
    main()
