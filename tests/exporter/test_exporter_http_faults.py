"""Hostile HTTP and load against the exporter daemon: it stays up and keeps answering others.

Everything talks to 127.0.0.1 only. Attacks are bounded in count and time. The load test runs
50 concurrent scrapers for DUALTRACK_LOAD_SECONDS (default 120, as the issue asks) and writes its
figures to load.json in the test's tmp dir (and prints them: run with -s to see them).
"""
from __future__ import annotations

import base64
import json
import os
import random
import select
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import prometheus_client
import pytest
import requests
import requests.adapters

from exporter.web import WebServer
from exporter.webconfig import load_web_config
from exporter.webtransport import HEADER_TIMEOUT, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT
from stack import processes
from stack.processes import Service, wait_until
from tests.support.certs import bcrypt_hash

pytestmark = pytest.mark.fault

LOAD_SECONDS = float(os.environ.get("DUALTRACK_LOAD_SECONDS", "120"))
LOAD_WARMUP_SECONDS = 15.0
SCRAPERS = 50
# A scrape of the daemon takes ~1 ms; under attack on a shared 2-core machine allow scheduling noise.
MAX_LATENCY_UNDER_ATTACK = 1.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[Service]:
    """The real exporter with 8 simulated GPUs, as a user would start it; shared by the attacks below."""
    service = processes.exporter(tmp_path_factory.mktemp("exporter"),
                                 ["--simulate=healthy", "--simulate.gpus=8", "--sample-interval=0.5"])
    service.start()
    yield service
    service.stop()


def scrape(url: str, session: requests.Session | None = None, timeout: float = 5.0) -> float:
    """One scrape of /metrics that must succeed with GPU data; returns its latency in seconds."""
    started = time.perf_counter()
    response = (session or requests).get(url + "/metrics", timeout=timeout)
    elapsed = time.perf_counter() - started
    assert response.status_code == 200 and "nvml_gpu_memory_used_bytes{" in response.text
    return elapsed


def exchange(port: int, payload: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes and read until the server closes (or `timeout`); returns what came back."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            raise
        except OSError:
            pass  # the server may close (or reset) before reading everything we sent
    return received


def status_of(response: bytes) -> int | None:
    """The status code of the first response in raw bytes, None when the server sent nothing."""
    if not response:
        return None
    return int(response.split(b" ", 2)[1])


_RNG = random.Random(5)
HOSTILE = {
    "unknown path": (b"GET /etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n", {404}),
    "path traversal": (b"GET /../../../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n", {404}),
    "64 KiB URI": (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", {414}),
    "70 KiB header line": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 70000 + b"\r\n\r\n", {431}),
    "101 headers": (
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n",
        {431}),
    "120 KiB of headers in 60 lines": (
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 2000) for i in range(60)) + b"\r\n",
        {431}),
    "no version": (b"GET\r\n\r\n", {400}),
    "too many words": (b"GET /metrics HTTP/1.1 extra\r\n\r\n", {400}),
    "HTTP/9.9": (b"GET /metrics HTTP/9.9\r\n\r\n", {505}),
    "bad version": (b"GET /metrics HTTQ/1.1\r\n\r\n", {400}),
    "CONNECT": (b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: x\r\n\r\n", {405}),
    "lowercase method": (b"get /metrics HTTP/1.1\r\nHost: x\r\n\r\n", {405}),
    "negative content length": (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", {400}),
    "NUL bytes": (b"GET /\x00\x00 HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    "binary garbage": (_RNG.randbytes(8192), {400, None}),
    "TLS hello to the HTTP port": (bytes.fromhex("160301020001"), {400, None}),
    "only line breaks": (b"\r\n" * 5000, {400, None}),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_requests_get_4xx_and_the_daemon_keeps_serving(daemon, name):
    payload, expected = HOSTILE[name]
    assert status_of(exchange(daemon.port, payload)) in expected
    assert daemon.running()
    assert scrape(daemon.url) < MAX_LATENCY_UNDER_ATTACK


def test_slow_clients_are_cut_off_and_others_served_meanwhile(daemon):
    """Slowloris: 40 sockets, half trickling a header byte a second, half silent, for at most 15 s."""
    count, started = 40, time.monotonic()
    sockets = [socket.create_connection(("127.0.0.1", daemon.port), timeout=5) for _ in range(count)]
    closed_after: dict[int, float] = {}
    latencies: list[float] = []
    trickle = b"GET /metrics HTTP/1.1\r\n" + b"X-Slow: " + b"z" * 100
    try:
        for second in range(int(HEADER_TIMEOUT) + 5):
            for index, sock in enumerate(sockets):
                if index in closed_after:
                    continue
                readable, _, _ = select.select([sock], [], [], 0)
                try:
                    if readable and not sock.recv(1024):
                        raise ConnectionResetError
                    if index % 2 == 0:
                        sock.send(trickle[second:second + 1])
                except OSError:
                    closed_after[index] = time.monotonic() - started
            latencies.append(scrape(daemon.url))
            if len(closed_after) == count:
                break
            time.sleep(max(0.0, started + second + 1 - time.monotonic()))
    finally:
        for sock in sockets:
            sock.close()
    print(f"\nslowloris: {count} sockets cut after "
          f"{min(closed_after.values()):.1f}-{max(closed_after.values()):.1f} s; "
          f"{len(latencies)} scrapes meanwhile, max {max(latencies) * 1000:.1f} ms")
    assert len(closed_after) == count, "the daemon must cut every slow client"
    assert max(closed_after.values()) < HEADER_TIMEOUT + 3
    assert max(latencies) < MAX_LATENCY_UNDER_ATTACK
    assert daemon.running()


def connect_from(source: str, port: int) -> socket.socket:
    """A TCP connection to 127.0.0.1:`port` from the loopback address `source` (all of 127/8 is local)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed (or reset) this idle connection."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def get_from(source: str, port: int, path: str = "/metrics", **kwargs) -> requests.Response:
    """GET 127.0.0.1:`port``path` with requests, from the loopback address `source`."""
    scheme = "https" if "verify" in kwargs else "http"
    with requests.Session() as session:
        adapter = SourceAddressAdapter(source)
        session.mount(f"{scheme}://", adapter)
        return session.get(f"{scheme}://127.0.0.1:{port}{path}", timeout=5, **kwargs)


class SourceAddressAdapter(requests.adapters.HTTPAdapter):
    """A requests adapter whose connections leave from a given local address."""

    def __init__(self, source: str) -> None:
        self._source = source
        super().__init__()

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, source_address=(self._source, 0), **kwargs)


def test_idle_sockets_from_one_client_past_every_cap_keep_no_one_out(daemon):
    """200 idle sockets from 127.0.0.1 (128 slots): scrapes from 127.0.0.2, and from 127.0.0.1 itself, answered."""
    idle = [connect_from("127.0.0.1", daemon.port) for _ in range(MAX_CONNECTIONS + 72)]
    try:
        # The accept loop has handled every socket once those past the caps are closed (at least 72).
        wait_until(lambda: sum(map(closed_by_server, idle)) >= len(idle) - MAX_CONNECTIONS, timeout=30,
                   what="the accept loop to handle every idle socket")
        answered = [get_from("127.0.0.2", daemon.port).status_code for _ in range(16)]
        assert answered == [200] * 16
        assert get_from("127.0.0.1", daemon.port).status_code == 200  # the idle client's own scrape too
        assert sum(not closed_by_server(sock) for sock in idle) <= MAX_CONNECTIONS_PER_CLIENT
    finally:
        for sock in idle:
            sock.close()
    assert daemon.running()


def guarded_server(tmp_path: Path, web_config: str, **limits) -> WebServer:
    """A started in-process WebServer serving `nvml_up 1` with the web config `web_config` (text)."""
    config = tmp_path / "web.yml"
    config.write_text(web_config)
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Gauge("nvml_up", "up", registry=registry).set(1)
    server = WebServer(registry, listen_address="127.0.0.1:0", telemetry_path="/metrics",
                       web_config=load_web_config(str(config)), ready=lambda: True, **limits)
    server.start()
    return server


def test_a_password_guessing_flood_from_two_addresses_leaves_the_right_password_served(tmp_path):
    """64 keep-alive guessers from each of two addresses send wrong passwords as fast as they are answered.
    A scraper from a third address is served all the while: 20 of 20 scrapes with its (cached) password,
    and a second user's first (uncached, so bcrypt) check too. A 401 closes its connection."""
    server = guarded_server(tmp_path, f"basic_auth_users:\n  prom: '{bcrypt_hash('pw', cost=10)}'\n"
                                      f"  other: '{bcrypt_hash('pw2', cost=10)}'\n")
    port = server.server_address[1]
    wrong = base64.b64encode(b"prom:guess").decode()
    guess = f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {wrong}\r\n\r\n".encode()
    stop, answered, guessers = threading.Event(), [], []

    def guesser(source: str) -> None:
        sock = None
        deadline = time.monotonic() + 60  # bounded whatever happens to the test
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                sock = sock or connect_from(source, port)
                sock.sendall(guess)
                reply = sock.recv(65536)
                answered.append(reply[:12])
                if not reply or b"Connection: close" in reply:
                    sock.close()
                    sock = None
            except OSError:
                if sock is not None:
                    sock.close()
                sock = None
        if sock is not None:
            sock.close()

    try:
        assert get_from("127.0.0.1", port, auth=("prom", "pw")).status_code == 200  # cached from now on
        first = exchange(port, guess)
        assert first.startswith(b"HTTP/1.1 401") and b"Connection: close" in first
        guessers += [threading.Thread(target=guesser, args=(source,), daemon=True)
                     for source in ["127.0.0.2", "127.0.0.3"] for _ in range(64)]
        for thread in guessers:
            thread.start()
        wait_until(lambda: len(answered) >= 20, timeout=30, what="the guessers to get answers")
        statuses = []
        for _ in range(20):
            try:
                statuses.append(get_from("127.0.0.1", port, auth=("prom", "pw")).status_code)
            except requests.RequestException as exc:
                statuses.append(type(exc).__name__)
        assert statuses == [200] * 20
        assert get_from("127.0.0.4", port, auth=("other", "pw2")).status_code == 200
    finally:
        stop.set()
        for thread in guessers:
            thread.join(10)
        server.shutdown()


def test_waiting_connections_make_room_before_tls_and_auth(pki, tmp_path):
    """Cap 8, 4 per client, TLS and basic auth: idle sockets from two addresses fill every slot; a third
    client is served all the same (its connection takes the slot of the longest waiting socket of a
    client holding the most), and a fifth socket from one address takes one of its own four."""
    server = guarded_server(tmp_path, f"tls_server_config:\n  cert_file: {pki.server_cert}\n"
                                      f"  key_file: {pki.server_key}\n"
                                      f"basic_auth_users:\n  prom: '{bcrypt_hash('pw', cost=4)}'\n",
                            header_timeout=60.0, max_connections=8, max_connections_per_client=4)
    port = server.server_address[1]
    first = [connect_from("127.0.0.1", port) for _ in range(5)]
    second = [connect_from("127.0.0.3", port) for _ in range(4)]
    try:
        wait_until(lambda: closed_by_server(first[0]), timeout=10, what="the 5th socket from one client to take "
                   "the slot of its 1st")
        response = get_from("127.0.0.2", port, auth=("prom", "pw"), verify=str(pki.ca_cert))
        assert response.status_code == 200 and "nvml_up 1.0" in response.text
        wait_until(lambda: closed_by_server(first[1]), timeout=10, what="the longest waiting socket to make room")
        assert not any(map(closed_by_server, first[2:] + second))
    finally:
        for sock in first + second:
            sock.close()
        server.shutdown()


def test_connections_serving_a_request_keep_their_slots():
    """When every slot is serving a request, a new connection is closed unanswered until one finishes."""
    gate, entered = threading.Event(), threading.Semaphore(0)

    def ready() -> bool:  # /-/ready runs in the connection's own thread: the request holds its slot
        entered.release()
        return gate.wait(30)

    registry = prometheus_client.CollectorRegistry()
    server = WebServer(registry, listen_address="127.0.0.1:0", telemetry_path="/metrics", web_config=None,
                       ready=ready, max_connections=8, max_connections_per_client=4)
    server.start()
    port = server.server_address[1]
    results: list[int] = []
    probes = [threading.Thread(target=lambda source=source: results.append(
                  get_from(source, port, "/-/ready").status_code))
              for source in ["127.0.0.1"] * 4 + ["127.0.0.3"] * 4]
    try:
        for probe in probes:
            probe.start()
        for _ in probes:
            assert entered.acquire(timeout=30)
        assert exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n") == b""
        gate.set()
        for probe in probes:
            probe.join(30)
        assert results == [200] * 8
        wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200,
                   timeout=10, what="a free slot once the requests are answered")
    finally:
        gate.set()
        server.shutdown()


def test_clients_that_never_read_their_replies_keep_no_one_out():
    """Every slot held by a connection that pipelines scrapes and never reads the replies (its reply
    blocked): past STALLED_WRITE such a connection makes room, and a new client is answered."""
    registry = prometheus_client.CollectorRegistry()
    wide = prometheus_client.Gauge("wide", "Many series: a reply that fills the socket buffers.", ["n"],
                                   registry=registry)
    for n in range(2000):
        wide.labels(str(n)).set(n)
    # A blocked write times out after header_timeout too: long enough here that only STALLED_WRITE can help.
    server = WebServer(registry, listen_address="127.0.0.1:0", telemetry_path="/metrics", web_config=None,
                       ready=lambda: True, max_connections=8, max_connections_per_client=4, header_timeout=60.0)
    server.start()
    port = server.server_address[1]
    hogs = []
    try:
        for source in ["127.0.0.2"] * 4 + ["127.0.0.3"] * 4:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 100)  # and never read
            hogs.append(sock)

        def answered() -> bool:
            try:
                return get_from("127.0.0.1", port, "/-/healthy").status_code == 200
            except requests.ConnectionError:  # closed unanswered: every slot still busy
                return False

        wait_until(answered, timeout=30, what="a new client answered while every slot's client does not read")
    finally:
        for sock in hogs:
            sock.close()
        server.shutdown()


def test_slow_tls_handshakes_are_cut_off_and_https_served_meanwhile(pki, tmp_path):
    """Clients that open the TLS port and stall mid-handshake never block the accept loop."""
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n")
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Gauge("nvml_up", "up", registry=registry).set(1)
    server = WebServer(registry, listen_address="127.0.0.1:0", telemetry_path="/metrics",
                       web_config=load_web_config(str(config)), ready=lambda: True, header_timeout=1.0)
    server.start()
    url = f"https://127.0.0.1:{server.server_address[1]}/metrics"
    stalled = [socket.create_connection(server.server_address, timeout=5) for _ in range(20)]
    try:
        for sock in stalled:
            sock.sendall(bytes.fromhex("16030100"))  # the start of a ClientHello, then nothing
        started = time.monotonic()
        assert requests.get(url, verify=str(pki.ca_cert), timeout=5).status_code == 200
        assert time.monotonic() - started < MAX_LATENCY_UNDER_ATTACK
        for sock in stalled:
            assert sock.recv(100) == b""  # closed by the server after header_timeout
        assert time.monotonic() - started < 4  # header timeout 1 s + lingering close up to 1 s
    finally:
        for sock in stalled:
            sock.close()
        server.shutdown()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def run_scrapers(url: str, seconds: float, record: Callable[[float | Exception], None]) -> None:
    """SCRAPERS threads, each with its own keep-alive session, scraping back to back for `seconds`.

    A scrape fails when it errs, lacks GPU data or takes over 10 s (Prometheus' default scrape_timeout).
    """
    deadline = time.monotonic() + seconds

    def scraper() -> None:
        with requests.Session() as session:
            while time.monotonic() < deadline:
                try:
                    record(scrape(url, session, timeout=10))
                except (AssertionError, requests.RequestException) as exc:
                    record(exc)

    threads = [threading.Thread(target=scraper, name=f"scraper-{i}") for i in range(SCRAPERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)


@pytest.mark.slow  # a 2-minute load test: pytest -m slow
def test_fifty_concurrent_scrapers_no_failure_and_bounded_memory(daemon, tmp_path):
    pid = daemon.proc.pid
    run_scrapers(daemon.url, LOAD_WARMUP_SECONDS, lambda latency: None)
    rss_before = rss_bytes(pid)

    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def record(outcome: float | Exception) -> None:
        with lock:
            if isinstance(outcome, Exception):
                failures.append(f"{type(outcome).__name__}: {outcome}"[:200])
            else:
                latencies.append(outcome)

    rss_trace: list[float] = []
    finished = threading.Event()

    def trace_rss() -> None:
        while not finished.wait(10):
            rss_trace.append(round(rss_bytes(pid) / 2**20, 2))

    tracer = threading.Thread(target=trace_rss)
    tracer.start()
    started = time.monotonic()
    run_scrapers(daemon.url, LOAD_SECONDS, record)
    duration = time.monotonic() - started
    finished.set()
    tracer.join()
    rss_after = rss_bytes(pid)

    cuts = statistics.quantiles(latencies, n=100)
    figures = {
        "command": "python -m pytest -m slow tests/exporter/test_exporter_http_faults.py -k fifty -s",
        "exporter_args": daemon.argv[3:], "scrapers": SCRAPERS, "seconds": round(duration, 1),
        "scrapes": len(latencies), "failed": len(failures), "scrapes_per_second": round(len(latencies) / duration, 1),
        "p50_ms": round(cuts[49] * 1000, 2), "p99_ms": round(cuts[98] * 1000, 2),
        "max_ms": round(max(latencies) * 1000, 2),
        "rss_after_warmup_mib": round(rss_before / 2**20, 2), "rss_end_mib": round(rss_after / 2**20, 2),
        "rss_growth_kib": round((rss_after - rss_before) / 1024, 1), "rss_every_10s_mib": rss_trace,
    }
    (tmp_path / "load.json").write_text(json.dumps(figures, indent=2))
    print("\nload:", json.dumps(figures))
    assert not failures, failures[:5]
    assert latencies, "no scrape completed"
    assert rss_after - rss_before < 2 * 2**20
    assert daemon.running()
