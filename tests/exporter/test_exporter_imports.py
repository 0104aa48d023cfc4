"""What the exporter daemon loads: the default daemon never imports prometheus_client, the HTTP
client and server modules, the email parser, ssl or hashlib (most of a Python daemon's memory);
a web config that asks for TLS and basic auth loads ssl, hashlib and bcrypt, and only then.

The daemon runs as a user starts it (`exporter.cli.main`, simulated GPUs, scraped over loopback);
a thread in it reports its sys.modules once the test has scraped it, then stops it with SIGTERM.
"""
from __future__ import annotations

import gzip
import os
import sys
from pathlib import Path

import requests

from stack import processes
from stack.processes import Service, wait_until
from tests.support.certs import bcrypt_hash
from tests.support.paths import REPO

HEAVY = ("prometheus_client", "http.server", "http.client", "email", "ssl", "hashlib", "urllib.request", "bcrypt",
         "yaml", "importlib.metadata", "statistics", "decimal")
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"

# Runs the CLI's main; a thread waits for the test's go-ahead (a file), writes which HEAVY modules are loaded, stops it.
DAEMON = """
import os, signal, sys, threading, time
from pathlib import Path
from exporter import cli
scraped, report = Path(sys.argv[1]), Path(sys.argv[2])
def watch():
    while not scraped.exists():
        time.sleep(0.05)
    report.write_text(" ".join(m for m in {heavy!r} if m in sys.modules) or "none")
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=watch, daemon=True).start()
sys.exit(cli.main(sys.argv[3:]))
"""


def modules_after_scrapes(tmp_path: Path, start_service, flags: list[str], scheme: str = "http",
                          **request_options) -> set[str]:
    """Start the daemon with `flags`, scrape it (text, OpenMetrics gzipped, probes), return the HEAVY
    modules it loaded."""
    port = processes.free_port()
    scraped, report = tmp_path / "scraped", tmp_path / "modules"
    argv = [sys.executable, "-c", DAEMON.format(heavy=HEAVY), str(scraped), str(report), "--simulate=healthy",
            "--simulate.gpus=2", "--sample-interval=0.2", f"--web.listen-address=127.0.0.1:{port}", *flags]
    service = start_service(Service("exporter", argv, port, tmp_path / "exporter.log", scheme=scheme,
                                    auth=request_options.get("auth"), env={**os.environ, "PYTHONPATH": str(REPO)}))
    url = service.url + "/metrics"
    wait_until(lambda: "nvml_gpu_utilization_ratio{" in requests.get(url, timeout=5, **request_options).text,
               timeout=30, what="GPU series served")
    om = requests.get(url, timeout=5, stream=True, headers={"Accept": OPENMETRICS, "Accept-Encoding": "gzip"},
                      **request_options)
    assert om.headers["Content-Encoding"] == "gzip" and gzip.decompress(om.raw.read()).endswith(b"# EOF\n")
    assert requests.head(url, timeout=5, **request_options).status_code == 200
    assert requests.get(service.url + "/", timeout=5, **request_options).status_code == 200
    scraped.touch()
    wait_until(report.exists, timeout=30, what="the daemon's module report")
    service.proc.wait(30)
    assert service.proc.returncode == 0
    return set(report.read_text().split()) - {"none"}


def test_the_default_daemon_serves_without_loading_any_heavy_module(tmp_path, start_service):
    assert modules_after_scrapes(tmp_path, start_service, []) == set()


def test_tls_and_basic_auth_load_ssl_hashlib_and_bcrypt_only_then(tmp_path, start_service, pki):
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
                      f"basic_auth_users:\n  prom: '{bcrypt_hash('pw', cost=4)}'\n")
    loaded = modules_after_scrapes(tmp_path, start_service, [f"--web.config.file={config}"], scheme="https",
                                   auth=("prom", "pw"), verify=str(pki.ca_cert))
    assert loaded == {"ssl", "hashlib", "bcrypt", "yaml"}
