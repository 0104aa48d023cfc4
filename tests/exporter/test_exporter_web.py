"""The exporter's HTTP layer: probes, telemetry path, methods, TLS, basic auth and the web-config file.

Real sockets and real clients (requests, openssl s_client, curl). Tests that need knobs a user cannot
turn (a readiness callback, a small registry) run `exporter.web.WebServer` in-process; the ones a user
would notice on the command line start `python -m exporter` as a daemon.
"""
from __future__ import annotations

import base64
import gzip
import os
import shutil
import socket
import ssl
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import prometheus_client
import pytest
import requests

from exporter.web import WebServer
from exporter.webconfig import WebConfig, WebConfigError, load_web_config
from stack import processes
from tests.support.certs import Pki, bcrypt_hash
from tests.support.paths import REPO

PASSWORD = "s3cret pass:word"


@pytest.fixture(scope="module")
def password_hash() -> str:
    return bcrypt_hash(PASSWORD)


@pytest.fixture
def registry() -> prometheus_client.CollectorRegistry:
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Gauge("nvml_up", "1 when NVML answers.", registry=registry).set(1)
    return registry


@pytest.fixture
def serve(registry) -> Iterator[Callable[..., str]]:
    """Start an in-process WebServer on a free loopback port; returns its base URL."""
    servers: list[WebServer] = []

    def start(web_config: WebConfig | None = None, *, telemetry_path: str = "/metrics",
              ready: Callable[[], bool] = lambda: True) -> str:
        server = WebServer(registry, listen_address="127.0.0.1:0", telemetry_path=telemetry_path,
                           web_config=web_config, ready=ready)
        server.start()
        servers.append(server)
        scheme = "https" if web_config and web_config.ssl_context else "http"
        return f"{scheme}://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()


def run_exporter(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m exporter --simulate=healthy ARGS` on loopback, expected to exit on its own."""
    return subprocess.run([sys.executable, "-m", "exporter", "--simulate=healthy", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


def assert_usage_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2 and exactly one line on stderr, containing every needle."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and all(needle in lines[0] for needle in needles), lines


def write_config(directory: Path, text: str) -> str:
    path = directory / "web.yml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def tls_config(pki: Pki, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n{extra}"


# --- plain HTTP ---------------------------------------------------------------------------------


def test_probes_landing_page_and_unknown_paths(serve):
    ready = {"value": False}
    url = serve(telemetry_path="/gpu-metrics", ready=lambda: ready["value"])

    assert requests.get(url + "/-/healthy", timeout=5).text == "Healthy\n"
    assert requests.get(url + "/-/ready", timeout=5).status_code == 503
    ready["value"] = True
    assert requests.get(url + "/-/ready", timeout=5).status_code == 200

    metrics = requests.get(url + "/gpu-metrics", timeout=5)
    assert metrics.status_code == 200 and "nvml_up 1.0" in metrics.text
    assert metrics.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    landing = requests.get(url + "/", timeout=5)
    assert landing.headers["Content-Type"].startswith("text/html") and 'href="/gpu-metrics"' in landing.text
    for path in ("/metrics", "/nope", "/-/", "/gpu-metrics/extra", "/%2e%2e/etc/passwd"):
        assert requests.get(url + path, timeout=5).status_code == 404, path


def test_only_get_and_head_are_allowed(serve):
    url = serve()
    head = requests.head(url + "/metrics", timeout=5)
    assert head.status_code == 200 and head.content == b"" and int(head.headers["Content-Length"]) > 0
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "FOO"):
        response = requests.request(method, url + "/metrics", data=b"x" * 1000, timeout=5)
        assert response.status_code == 405, method
        assert response.headers["Allow"] == "GET, HEAD"
    assert requests.get(url + "/metrics", timeout=5).status_code == 200


def test_openmetrics_and_gzip_are_negotiated_like_client_python(serve):
    url = serve()
    response = requests.get(url + "/metrics", timeout=5, headers={
        "Accept": "application/openmetrics-text; version=1.0.0,text/plain;q=0.5", "Accept-Encoding": "gzip"})
    assert response.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert response.headers["Content-Encoding"] == "gzip"
    assert response.text.endswith("# EOF\n")  # requests decompressed it
    raw = requests.get(url + "/metrics", timeout=5, stream=True, headers={"Accept-Encoding": "gzip"}).raw.read()
    assert b"nvml_up 1.0" in gzip.decompress(raw)
    # the gzip header's XFL: compressed at the fastest level (a scrape's CPU matters more than bytes)
    assert raw[8] == 4
    plain = requests.get(url + "/metrics", timeout=5, headers={"Accept-Encoding": "identity"})
    assert "Content-Encoding" not in plain.headers and "nvml_up 1.0" in plain.text
    for reply in (response, plain):  # a cache between scraper and exporter keeps the two apart
        assert reply.headers["Vary"] == "Accept, Accept-Encoding"


def test_a_failing_collector_gives_500_and_the_server_keeps_serving(serve, registry):
    class Broken:
        def collect(self):
            raise RuntimeError("collector bug")

    url = serve()
    broken = Broken()
    registry.register(broken)
    assert requests.get(url + "/metrics", timeout=5).status_code == 500
    assert requests.get(url + "/-/healthy", timeout=5).status_code == 200
    registry.unregister(broken)
    assert requests.get(url + "/metrics", timeout=5).status_code == 200


def test_busy_port_raises_oserror(registry):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = WebServer(registry, listen_address=f"127.0.0.1:{taken.getsockname()[1]}",
                           telemetry_path="/metrics", web_config=None, ready=lambda: True)
        with pytest.raises(OSError):
            server.start()


@pytest.mark.parametrize("flag, message", [
    ("--web.listen-address=9942", "is not [host]:port"),
    ("--web.listen-address=::1:9942", "IPv6 hosts in brackets"),
    ("--web.listen-address=127.0.0.1:99999", "is not [host]:port"),
    ("--web.telemetry-path=metrics", "must be a path"),
    ("--web.telemetry-path=/-/ready", "must be a path"),
])
def test_bad_web_flags_exit_2_with_one_line(flag, message, tmp_path):
    done = run_exporter(flag, cwd=tmp_path)
    assert_usage_error(done, message)


# --- TLS ----------------------------------------------------------------------------------------


def test_tls_with_a_test_ca_and_plain_http_refused(serve, pki, tmp_path):
    url = serve(load_web_config(write_config(tmp_path, tls_config(pki))))
    assert url.startswith("https://")

    response = requests.get(url + "/metrics", verify=str(pki.ca_cert), timeout=5)
    assert response.status_code == 200 and "nvml_up 1.0" in response.text
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(url + "/metrics", verify=str(pki.other_ca_cert), timeout=5)

    plain = requests.get(url.replace("https://", "http://") + "/metrics", timeout=5)
    assert plain.status_code == 400 and "HTTP request to an HTTPS server" in plain.text
    assert "nvml_up" not in plain.text
    # raw bytes that are neither HTTP nor TLS: the handshake fails and the connection is closed
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5) as raw:
        raw.sendall(b"\x00\x01garbage" * 100)
        assert raw.recv(100) == b""
    assert requests.get(url + "/-/healthy", verify=str(pki.ca_cert), timeout=5).status_code == 200


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_openssl_s_client_sees_the_min_version(serve, pki, tmp_path):
    url = serve(load_web_config(write_config(tmp_path, tls_config(pki, "  min_version: TLS13\n"))))
    port = url.rsplit(":", 1)[1]

    def s_client(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-CAfile", str(pki.ca_cert),
                               "-verify_return_error", *flags], input=b"", capture_output=True, timeout=30)

    good = s_client("-tls1_3")
    assert good.returncode == 0 and b"Verify return code: 0 (ok)" in good.stdout
    assert s_client("-tls1_2").returncode != 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_with_tls_and_basic_auth(serve, pki, tmp_path, password_hash):
    users = f"basic_auth_users:\n  prom: '{password_hash}'\n"
    url = serve(load_web_config(write_config(tmp_path, tls_config(pki) + users)))

    def curl(*flags: str) -> str:
        return subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(pki.ca_cert),
                               *flags, url + "/metrics"], capture_output=True, text=True, timeout=30).stdout

    assert curl("-u", f"prom:{PASSWORD}") == "200"
    assert curl("-u", "prom:wrong") == "401"
    assert curl() == "401"


def test_client_certificates_are_required_and_sans_checked(serve, pki, tmp_path):
    def config(sans: str) -> WebConfig:
        return load_web_config(write_config(tmp_path, tls_config(pki, (
            f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca_cert}\n"
            f"  client_allowed_sans: [{sans}]\n"))))

    url = serve(config("prometheus.test"))
    client = (str(pki.client_cert), str(pki.client_key))
    assert requests.get(url + "/metrics", verify=str(pki.ca_cert), cert=client, timeout=5).status_code == 200
    with pytest.raises((requests.exceptions.SSLError, requests.exceptions.ConnectionError)):
        requests.get(url + "/metrics", verify=str(pki.ca_cert), timeout=5)

    other = serve(config("someone-else.test"))
    assert requests.get(other + "/metrics", verify=str(pki.ca_cert), cert=client, timeout=5).status_code == 403


# --- basic auth ---------------------------------------------------------------------------------


def test_basic_auth_guards_every_path(serve, tmp_path, password_hash):
    url = serve(load_web_config(write_config(tmp_path, f"""\
        basic_auth_users:
          prom: '{password_hash}'
          other: '{bcrypt_hash("other")}'
        http_server_config:
          headers:
            X-Content-Type-Options: nosniff
            X-Frame-Options: deny
        """)))
    ok = requests.get(url + "/metrics", auth=("prom", PASSWORD), timeout=5)
    assert ok.status_code == 200 and "nvml_up 1.0" in ok.text
    assert ok.headers["X-Content-Type-Options"] == "nosniff" and ok.headers["X-Frame-Options"] == "deny"
    assert requests.get(url + "/metrics", auth=("other", "other"), timeout=5).status_code == 200

    for auth in (("prom", "wrong"), ("prom", PASSWORD + " "), ("nobody", PASSWORD), ("other", PASSWORD), None):
        for path in ("/metrics", "/-/healthy", "/-/ready", "/", "/nope"):
            denied = requests.get(url + path, auth=auth, timeout=5)
            assert denied.status_code == 401, (auth, path)
            assert denied.headers["WWW-Authenticate"].startswith("Basic ")
            assert "nvml_up" not in denied.text
    for header in ("Basic !!!notbase64", "Basic " + "cHJvbQ==", "Bearer abc", "Basic"):
        assert requests.get(url + "/metrics", headers={"Authorization": header}, timeout=5).status_code == 401
    # the right password still works after the failures (its success is cached)
    assert requests.get(url + "/metrics", auth=("prom", PASSWORD), timeout=5).status_code == 200


# --- web-config validation ----------------------------------------------------------------------


@pytest.mark.parametrize("text, problem", [
    ("tls_server_config: [unclosed\n", "invalid YAML at line 2, column 1"),
    ("basic_auth_users:\n  prom: hunter2\n", "must be a bcrypt hash, not plain text"),
    ("basic_auth_users:\n  prom: $2b$10$short\n", "must be a bcrypt hash"),
    ("basic_auth_user:\n  prom: x\n", "unknown key 'basic_auth_user'"),
    ("tls_server_config:\n  cert_file: /nonexistent/server.crt\n  key_file: KEY\n", "No such file or directory"),
    ("tls_server_config:\n  cert_file: CERT\n", "key_file is missing"),
    ("tls_server_config:\n  cert_file: CERT\n  key_file: CERT\n", "cannot load the certificate and key"),
    ("tls_server_config:\n  min_version: TLS13\n", "cert_file and key_file are required"),
    ("tls_server_config:\n  cert_file: CERT\n  key_file: KEY\n  min_version: TLS1.2\n", "is not one of TLS10"),
    ("tls_server_config:\n  cert_file: CERT\n  key_file: KEY\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
     "cipher_suites is not supported"),
    ("tls_server_config:\n  cert_file: CERT\n  key_file: KEY\n  client_auth_type: RequireAndVerifyClientCert\n",
     "needs client_ca_file"),
    ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n", "is not one of deny, sameorigin"),
    ("http_server_config:\n  headers:\n    Content-Security-Policy: default-src \u2018self\u2019\n",
     "must be a single line of printable ASCII"),
    ("basic_auth_users:\n  prom: |\n    $2b$04$VNSVF/.FAvElI3Ap7ijfkOg.v6zvSqpMDiKGOMuvKvNM6T9LOIloS\n",
     "must be a bcrypt hash"),  # a block scalar keeps a final line break
    ("- just\n- a list\n", "expected a mapping"),
])
def test_malformed_web_config_is_one_clear_line(text, problem, pki, tmp_path):
    text = text.replace("CERT", str(pki.server_cert)).replace("KEY", str(pki.server_key))
    with pytest.raises(WebConfigError) as error:
        load_web_config(write_config(tmp_path, text))
    message = str(error.value)
    assert problem in message and "\n" not in message
    assert message.startswith(f"web config {tmp_path / 'web.yml'}")


def test_web_config_loads_inline_pem_relative_paths_and_empty_files(pki, tmp_path):
    inline = load_web_config(write_config(tmp_path, "tls_server_config:\n  cert: |\n" +
                                          textwrap.indent(pki.server_cert.read_text(), "    ") + "  key: |\n" +
                                          textwrap.indent(pki.server_key.read_text(), "    ")))
    assert isinstance(inline.ssl_context, ssl.SSLContext)
    assert inline.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_2
    relative = load_web_config(write_config(pki.server_cert.parent, "tls_server_config:\n  cert_file: server.crt\n"
                                                                    "  key_file: server.key\n"))
    assert relative.ssl_context is not None
    empty = load_web_config(write_config(tmp_path, ""))
    assert empty.ssl_context is None and not empty.users
    with pytest.raises(WebConfigError, match="cannot read: No such file or directory"):
        load_web_config(str(tmp_path / "missing.yml"))


# --- the HTTP/1.1 transport ----------------------------------------------------------------------


def read_replies(sock: socket.socket, count: int, head_request: int | None = None
                 ) -> list[tuple[str, dict[str, str], bytes]]:
    """`count` replies read off a raw connection: (status line, headers by lower-case name, body);
    `head_request`: the index of the one that answers a HEAD request (no body)."""
    data, replies = b"", []
    while len(replies) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(replies)} replies"
            data += chunk
        head, data = data.split(b"\r\n\r\n", 1)
        status, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        length = int(headers["content-length"]) if head_request is None or len(replies) != head_request else 0
        while len(data) < length:
            data += sock.recv(65536)
        replies.append((status, headers, data[:length]))
        data = data[length:]
    return replies


def closed(sock: socket.socket) -> bool:
    """True when the server closes the connection (within the socket's timeout), False if it stays open."""
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_keep_alive_pipelining_and_close_as_http_1_1_and_1_0_ask(serve):
    port = int(serve().rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:  # two pipelined requests, then a third
        sock.sendall(b"\r\nGET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\nHEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        (status, headers, body), (head_status, head_headers, head_body) = read_replies(sock, 2, head_request=1)
        assert status == "HTTP/1.1 200 OK" and body == b"Healthy\n" and "connection" not in headers
        assert headers["server"] == "dualtrack-exporter" and headers["date"].endswith(" GMT")
        assert head_status == "HTTP/1.1 200 OK" and head_body == b"" and int(head_headers["content-length"]) > 0
        sock.sendall(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_replies(sock, 1)[0][0] == "HTTP/1.1 404 Not Found"
        assert not closed(sock)  # kept alive
    for request in (b"GET /-/healthy HTTP/1.0\r\n\r\n",
                    b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                    b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"):  # a body is never read
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request)
            (status, headers, _), = read_replies(sock, 1)
            assert status == "HTTP/1.1 200 OK" and headers["connection"] == "close" and closed(sock), request
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(b"GET /-/healthy HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
        (status, headers, _), = read_replies(sock, 1)
        assert status == "HTTP/1.1 200 OK" and headers["connection"] == "keep-alive" and not closed(sock)
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:  # empty lines before a request line
        sock.sendall(b"\r\n\r\n\r\nGET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_replies(sock, 1)[0][0] == "HTTP/1.1 200 OK"


def test_a_kept_alive_connection_waits_past_the_head_timeout_for_its_next_request(registry):
    """A scraper's connection (and its TLS session) lasts from one scrape to the next: the head's deadline
    runs from the request's first byte, not from the last reply. A trickled head is still cut off."""
    server = WebServer(registry, listen_address="127.0.0.1:0", telemetry_path="/metrics", web_config=None,
                       ready=lambda: True, header_timeout=0.5)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as sock:
            for _ in range(2):
                sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_replies(sock, 1)[0][0] == "HTTP/1.1 200 OK"
                sock.settimeout(1.5)
                assert not closed(sock)  # three head timeouts idle, still open
            sock.settimeout(5)
            sock.sendall(b"GET /-/healthy HTTP/1.1\r\n")  # ... then a head that never ends
            assert closed(sock)
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as sock:
            sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_replies(sock, 1)[0][0] == "HTTP/1.1 200 OK"
            server.shutdown()  # ... and a kept-alive connection ends with the server
            assert closed(sock)
    finally:
        server.shutdown()


@pytest.mark.parametrize("request_head, status", [
    (b"GET /\r\n\r\n", "400 Bad Request"),  # HTTP/0.9: refused, as Go does
    (b"GET / HTTP/2.0\r\n\r\n", "505 HTTP Version Not Supported"),
    (b"GET / HTTP/0.9\r\n\r\n", "505 HTTP Version Not Supported"),
    (b"GET / HTTP/1.10\r\nHost: x\r\n\r\n", "400 Bad Request"),  # one digit each side, as Go
    (b"GET / HTTP/1." + b"1" * 5000 + b"\r\nHost: x\r\n\r\n", "400 Bad Request"),  # (int() refuses 4,300 digits)
    (b"GET / HTTP/1.1\r\n\r\n", "400 Bad Request"),  # HTTP/1.1 needs one Host (RFC 9112 3.2), as Go
    (b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", "400 Bad Request"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n", "400 Bad Request"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\n\r\n", "400 Bad Request"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-A : 1\r\n\r\n", "400 Bad Request"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nAccept: text/plain\rSet-Cookie: x=1\r\n\r\n", "400 Bad Request"),  # a bare CR
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\x002\r\n\r\n", "400 Bad Request"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\x1b[31m2\r\n\r\n", "400 Bad Request"),  # a control character
    (b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n", "400 Bad Request"),  # a target byte outside visible ASCII
    (b"GET http://[/metrics HTTP/1.1\r\nHost: x\r\n\r\n", "400 Bad Request"),  # no URL
    (b"HEAD http://[/metrics HTTP/1.1\r\nHost: x\r\n\r\n", "400 Bad Request"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", "400 Bad Request"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\nab", "400 Bad Request"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", "501 Not Implemented"),
])
def test_malformed_request_heads_get_an_error_and_close(serve, request_head, status):
    port = int(serve().rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request_head)
        head = request_head.startswith(b"HEAD ")
        (line, headers, body), = read_replies(sock, 1, head_request=0 if head else None)
        assert line == "HTTP/1.1 " + status and body == (b"" if head else (status + "\n").encode())
        assert headers["connection"] == "close" and closed(sock)


def test_a_path_is_matched_percent_decoded(serve):
    port = int(serve().rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /%2D/healthy HTTP/1.1\r\nHost: x\r\n\r\nGET /%6Detrics HTTP/1.1\r\nHost: x\r\n\r\n")
        (healthy, _, body), (metrics, _, _) = read_replies(sock, 2)
        assert healthy == metrics == "HTTP/1.1 200 OK" and body == b"Healthy\n"


def test_a_head_request_gets_no_body_whatever_the_status(serve, tmp_path, password_hash):
    """A HEAD refused (401) carries no body and closes its connection (a password guesser gets one try per
    connection); an answered HEAD carries none either: one would be read as the start of the next reply."""
    url = serve(load_web_config(write_config(tmp_path, f"basic_auth_users:\n  prom: '{password_hash}'\n")))
    authorization = "Basic " + base64.b64encode(f"prom:{PASSWORD}".encode()).decode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization.encode() + b"\r\n\r\n")
        [(refused, headers, body)] = read_replies(sock, 1, head_request=0)
        assert refused == "HTTP/1.1 401 Unauthorized" and int(headers["content-length"]) > 0 and body == b""
        assert headers["connection"] == "close" and closed(sock)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"HEAD /-/healthy HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization.encode() + b"\r\n\r\n"
                     b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization.encode() + b"\r\n\r\n")
        (head, headers, body), (healthy, _, healthy_body) = read_replies(sock, 2, head_request=0)
        assert head == "HTTP/1.1 200 OK" and int(headers["content-length"]) > 0 and body == b""
        assert healthy == "HTTP/1.1 200 OK" and healthy_body == b"Healthy\n"


def test_the_web_configs_headers_go_on_every_reply(serve):
    url = serve(WebConfig(headers={"X-Content-Type-Options": "nosniff", "X-Frame-Options": "deny"}))
    for method, path, status in (("GET", "/metrics", 200), ("GET", "/nope", 404), ("POST", "/metrics", 405)):
        response = requests.request(method, url + path, timeout=5)
        assert response.status_code == status
        assert response.headers["X-Content-Type-Options"] == "nosniff" and response.headers["X-Frame-Options"] == "deny"


# --- the daemon, as a user starts it --------------------------------------------------------------




def test_daemon_with_tls_and_basic_auth(start_service, pki, tmp_path, password_hash):
    config = write_config(tmp_path, tls_config(pki) + f"basic_auth_users:\n  prometheus: '{password_hash}'\n")
    service = processes.exporter(tmp_path, ["--simulate=healthy", f"--web.config.file={config}",
                                            "--web.telemetry-path=/gpu-metrics"], scheme="https")
    service.auth = ("prometheus", PASSWORD)
    start_service(service)
    ca = str(pki.ca_cert)

    ok = requests.get(service.url + "/gpu-metrics", auth=service.auth, verify=ca, timeout=5)
    assert ok.status_code == 200 and 'nvml_gpu_info{' in ok.text and 'simulated="true"' in ok.text
    assert requests.get(service.url + "/metrics", auth=service.auth, verify=ca, timeout=5).status_code == 404
    # passwords past bcrypt's 72 bytes (bcrypt 5 raises on them), for a known and an unknown user
    for auth in (("prometheus", "wrong"), ("admin", PASSWORD), None, ("prometheus", PASSWORD + "x" * 80),
                 ("admin", "y" * 73)):
        denied = requests.get(service.url + "/gpu-metrics", auth=auth, verify=ca, timeout=5)
        assert denied.status_code == 401 and "nvml_" not in denied.text
    plain = requests.get(f"http://{service.address}/gpu-metrics", auth=service.auth, timeout=5)
    assert plain.status_code == 400 and "nvml_" not in plain.text
    assert requests.get(service.url + "/-/ready", auth=service.auth, verify=ca, timeout=5).status_code == 200
    assert service.running()


@pytest.mark.parametrize("text, problem", [
    ("basic_auth_users: {prometheus: [unclosed\n", "invalid YAML"),
    ("basic_auth_users:\n  prometheus: hunter2\n", "must be a bcrypt hash"),
    ("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n", "No such file or directory"),
    ("tls_server_config:\n  certfile: server.crt\n", "unknown key 'certfile'"),
])
def test_daemon_with_a_malformed_web_config_exits_2_with_one_line(text, problem, tmp_path):
    config = write_config(tmp_path, text)
    done = run_exporter("--web.listen-address=127.0.0.1:0", f"--web.config.file={config}", cwd=tmp_path)
    assert_usage_error(done, problem, config)
