"""The exporter's HTTP server: telemetry path, health/readiness probes, TLS and basic auth.

Built on `http.server` with one daemon thread per connection. Hostile clients are bounded:
a connection must deliver a complete request head within HEADER_TIMEOUT seconds in total (a
slowloris client trickling one byte a second is cut off), the head may not exceed MAX_HEADER_BYTES,
at most MAX_CONNECTIONS connections are served at once (more are closed on accept), and the TLS
handshake runs in the connection's thread so a slow handshake never blocks `accept`. No request
can stop the server: every error is confined to its connection. Concurrent scrapes share one
rendering of the registry, done in a dedicated thread (see _Renderer).
"""
from __future__ import annotations

import argparse
import base64
import binascii
import concurrent.futures
import functools
import gzip
import hashlib
import html
import http.client
import io
import logging
import socket
import socketserver
import ssl
import threading
import time
from collections import OrderedDict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, urlsplit

import bcrypt
from prometheus_client.exposition import choose_encoder, gzip_accepted

from exporter.webconfig import WebConfig

DEFAULT_LISTEN_ADDRESS = "127.0.0.1:9942"  # loopback unless asked (containers pass :9942)
DEFAULT_TELEMETRY_PATH = "/metrics"
HEADER_TIMEOUT = 10.0
MAX_HEADER_BYTES = 96 * 1024  # the request line alone may be 64 KiB, as http.server allows
MAX_CONNECTIONS = 128
AUTH_CACHE_SIZE = 64
RENDER_TIMEOUT = 10.0  # Prometheus' default scrape_timeout; rendering serves a snapshot and takes ms
_PROBE_PATHS = ("/-/healthy", "/-/ready")
_HTTP_METHODS = (b"GET ", b"HEAD ", b"POST ", b"PUT ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")

log = logging.getLogger("exporter.web")
Render = Callable[[str | None], tuple[bytes, str]]  # Accept header -> (body, content type)


def render_registry(registry, accept: str | None) -> tuple[bytes, str]:
    """`registry` rendered by prometheus_client in the format an Accept header asks for, and its content type."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def check_listen_address(value: str) -> str:
    """Check a `[host]:port` listen address (argparse type); return it unchanged."""
    parse_listen_address(value)
    return value


def parse_listen_address(value: str) -> tuple[str, int]:
    """Split `[host]:port` (IPv6 hosts in brackets) into (host, port); "" host means all interfaces."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"listen address {value!r} is not [host]:port (e.g. :9942 or 127.0.0.1:9942)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"listen address {value!r}: write IPv6 hosts in brackets, e.g. [::1]:9942")
    return host, int(port)


def check_telemetry_path(value: str) -> str:
    """Check a telemetry path (argparse type); return it unchanged."""
    if not value.startswith("/") or value in ("/", *_PROBE_PATHS) or any(c in value for c in "?# \t\r\n"):
        raise argparse.ArgumentTypeError(f"telemetry path {value!r} must be a path like /metrics (not /, /-/healthy or /-/ready)")
    return value


def add_web_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --web.listen-address, --web.telemetry-path and --web.config.file (dests web_listen_address, ...)."""
    parser.add_argument("--web.listen-address", dest="web_listen_address", metavar="[HOST]:PORT",
                        type=check_listen_address, default=DEFAULT_LISTEN_ADDRESS,
                        help="address to serve metrics on; an empty host means all interfaces (default %(default)s)")
    parser.add_argument("--web.telemetry-path", dest="web_telemetry_path", metavar="PATH", type=check_telemetry_path,
                        default=DEFAULT_TELEMETRY_PATH, help="path under which metrics are served (default %(default)s)")
    parser.add_argument("--web.config.file", dest="web_config_file", metavar="FILE", default=None,
                        help="exporter-toolkit web config (TLS, basic auth); see docs/security.md")


class _Authenticator:
    """Basic-auth check against bcrypt hashes, with successful checks cached.

    bcrypt costs ~100-250 ms by design; a Prometheus scrape every 15 s must not pay that each time, so
    a success is remembered under a SHA-256 of (user, hash, password), as exporter-toolkit does.
    Failures are not cached, and bcrypt runs one check at a time, so a password-guessing flood costs
    at most one core. Unknown users are checked against a dummy hash of the same cost, so timing
    does not reveal which users exist.
    """

    def __init__(self, users: dict[str, bytes], cache: bool = True) -> None:
        self._users = users
        self._cache: OrderedDict[bytes, None] | None = OrderedDict() if cache else None
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        self._dummy: bytes | None = None

    def check(self, header: str | None) -> bool:
        """True when the Authorization header carries a configured user and its password."""
        user, password = _basic_credentials(header)
        if user is None:
            return False
        hashed = self._users.get(user)
        key = hashlib.sha256(repr((user, hashed, password)).encode()).digest()
        if hashed is not None and self._cache is not None:
            with self._cache_lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    return True
        with self._bcrypt_lock:
            if hashed is None:
                bcrypt.checkpw(password, self._dummy_hash())
                return False
            ok = bcrypt.checkpw(password, hashed)
        if ok and self._cache is not None:
            with self._cache_lock:
                self._cache[key] = None
                if len(self._cache) > AUTH_CACHE_SIZE:
                    self._cache.popitem(last=False)
        return ok

    def _dummy_hash(self) -> bytes:
        if self._dummy is None:
            cost = int(next(iter(self._users.values())).split(b"$")[2])
            self._dummy = bcrypt.hashpw(b"dualtrack-no-such-user", bcrypt.gensalt(cost))
        return self._dummy


def _basic_credentials(header: str | None) -> tuple[str | None, bytes]:
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return None, b""
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).partition(b":")
        return (user.decode("utf-8"), password) if sep else (None, b"")
    except (binascii.Error, UnicodeDecodeError):
        return None, b""


class _Renderer:
    """Renders the exposition in one dedicated thread; concurrent requests for the same output share it.

    Sharing (Go's singleflight): rendering hundreds of series is milliseconds of GIL-bound Python;
    when many scrapes arrive at once (HA Prometheus pairs, the load test's 50 scrapers) one rendering
    serves all of them, so latency stays flat instead of growing with the queue. A scrape that joins
    gets output whose rendering began at most one rendering before it arrived (the data come from
    the sampler's snapshot anyway).
    One thread: rendering allocates the large strings; done by whichever connection thread came first,
    it made each of glibc's per-thread malloc arenas grow to hold them (resident memory crept up by
    about 1 MB a minute under 50 scrapers; 0.2 MB with one rendering thread).
    """

    class _Call:
        def __init__(self) -> None:
            self.done = threading.Event()
            self.result: tuple[bytes, str] = (b"", "")
            self.error: BaseException | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[object, _Renderer._Call] = {}
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="exporter-render")

    def run(self, key: object, function: Callable[[], tuple[bytes, str]]) -> tuple[bytes, str]:
        """The result of `function()`, shared with the callers that ask for the same `key` meanwhile."""
        with self._lock:
            call = self._calls.get(key)
            leader = call is None
            if leader:
                call = self._calls[key] = self._Call()
        if leader:
            try:
                call.result = self._thread.submit(function).result(timeout=RENDER_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - handed to every caller below
                call.error = exc
            finally:
                with self._lock:
                    del self._calls[key]
                call.done.set()
        else:
            call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def close(self) -> None:
        self._thread.shutdown(wait=False)


class _HeadReader(io.RawIOBase):
    """Socket reader that enforces a total deadline and byte budget while a request head is read.

    Socket timeouts apply per recv(), so alone they let a client trickling a byte a second hold a
    connection for hours; here every recv() gets only the time left until the head's deadline.
    """

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self._timeout = timeout
        self.deadline: float | None = None
        self.budget = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request head not received in time")
            self._sock.settimeout(left)
            if self.budget <= 0:
                raise http.client.LineTooLong("request head")
            buffer = memoryview(buffer)[:self.budget]
        count = self._sock.recv_into(buffer)
        if self.deadline is not None:
            self.budget -= count
            self._sock.settimeout(self._timeout)
        return count


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # so that even a garbage request line gets a status line back
    error_message_format = "%(code)d %(message)s\n"
    error_content_type = "text/plain; charset=utf-8"

    def version_string(self) -> str:
        return "dualtrack-exporter"

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced below; closing releases its reference on the socket
        self._head = _HeadReader(self.connection, self.server.header_timeout)
        self.rfile = io.BufferedReader(self._head)

    def handle_one_request(self) -> None:
        self._head.deadline = time.monotonic() + self.server.header_timeout
        self._head.budget = MAX_HEADER_BYTES
        try:
            super().handle_one_request()
        except http.client.LineTooLong:  # budget exhausted while reading the request line
            self.requestline = self.request_version = self.command = ""
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
        finally:
            self._head.deadline = None

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self._head.deadline = None
        return ok

    def end_headers(self) -> None:
        for name, value in self.server.extra_headers.items():
            self.send_header(name, value)
        super().end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def __getattr__(self, name: str):
        if name.startswith("do_"):  # any other method: 405, not http.server's 501
            return self._method_not_allowed
        raise AttributeError(name)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _method_not_allowed(self) -> None:
        self.close_connection = True  # a request body, if any, is left unread
        if self._authorized():
            self._reply(HTTPStatus.METHOD_NOT_ALLOWED, b"Method Not Allowed\n", extra={"Allow": "GET, HEAD"})

    def _authorized(self) -> bool:
        """Check client SANs and basic auth; on failure send the error reply and return False."""
        if self.server.allowed_sans and not self._san_allowed():
            self._reply(HTTPStatus.FORBIDDEN, b"Forbidden\n")
            return False
        if self.server.authenticator and not self.server.authenticator.check(self.headers.get("Authorization")):
            self._reply(HTTPStatus.UNAUTHORIZED, b"Unauthorized\n",
                        extra={"WWW-Authenticate": 'Basic realm="dualtrack-exporter", charset="UTF-8"'})
            return False
        return True

    def _san_allowed(self) -> bool:
        cert = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
        names = {value for _, value in (cert or {}).get("subjectAltName", ())}
        return bool(names & set(self.server.allowed_sans))

    def _serve(self, head: bool) -> None:
        if not self._authorized():
            return
        url = urlsplit(self.path)
        if url.path == self.server.telemetry_path:
            self._metrics(parse_qs(url.query), head)
        elif url.path == "/-/healthy":
            self._reply(HTTPStatus.OK, b"Healthy\n", head=head)
        elif url.path == "/-/ready":
            ready = self.server.is_ready()
            self._reply(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                        b"Ready\n" if ready else b"Not ready\n", head=head)
        elif url.path == "/":
            self._reply(HTTPStatus.OK, self.server.landing_page, "text/html; charset=utf-8", head=head)
        else:
            self._reply(HTTPStatus.NOT_FOUND, b"Not Found\n", head=head)

    def _metrics(self, params: dict[str, list[str]], head: bool) -> None:
        accept = self.headers.get("Accept")
        names = tuple(sorted(params.get("name[]", ())))
        compress = gzip_accepted(self.headers.get("Accept-Encoding"))
        try:
            body, content_type = self.server.renders.run((accept, names, compress),
                                                         lambda: self.server.render(accept, names, compress))
        except Exception:  # a collector bug must not take the server down; the scrape reports 500
            log.exception("rendering metrics failed")
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, b"error rendering metrics\n", head=head)
            return
        self._reply(HTTPStatus.OK, body, content_type, head=head,
                    extra={"Content-Encoding": "gzip"} if compress else None)

    def _reply(self, status: HTTPStatus, body: bytes, content_type: str = "text/plain; charset=utf-8",
               head: bool = False, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with a connection cap, per-connection TLS handshake and quiet errors."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], family: int, *, registry, render: Render | None,
                 telemetry_path: str, web_config: WebConfig | None, ready: Callable[[], bool], header_timeout: float,
                 max_connections: int, auth_cache: bool) -> None:
        self.address_family = family
        super().__init__(address, _Handler, bind_and_activate=False)
        config = web_config or WebConfig()
        self.registry = registry
        self.render_all = render or functools.partial(render_registry, registry)
        self.telemetry_path = telemetry_path
        self.ready = ready
        self.header_timeout = header_timeout
        self.ssl_context = config.ssl_context
        self.extra_headers = dict(config.headers)
        self.allowed_sans = config.client_allowed_sans
        self.authenticator = _Authenticator(dict(config.users), cache=auth_cache) if config.users else None
        self.landing_page = _landing_page(telemetry_path)
        self.renders = _Renderer()
        self._max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._limit_logged = -1e9

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # ":port" = IPv4 and IPv6
        socketserver.TCPServer.server_bind(self)  # skip HTTPServer's getfqdn(): a DNS lookup at start-up
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def render(self, accept: str | None, names: tuple[str, ...], compress: bool) -> tuple[bytes, str]:
        if names and hasattr(self.registry, "restricted_registry"):  # filtered scrapes are rare: the generic way
            body, content_type = render_registry(self.registry.restricted_registry(names), accept)
        else:
            body, content_type = self.render_all(accept)
        return gzip.compress(body, compresslevel=6) if compress else body, content_type

    def is_ready(self) -> bool:
        try:
            return bool(self.ready())
        except Exception:  # noqa: BLE001 - a failing readiness callback means not ready
            log.exception("readiness check failed")
            return False

    def process_request(self, request: socket.socket, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            if time.monotonic() - self._limit_logged > 60:  # once a minute: an attack must not flood the log
                self._limit_logged = time.monotonic()
                log.warning("%d connections open: closing new ones (from %s) until some finish",
                            self._max_connections, client_address[0])
            self.close_request(request)  # at once: draining here would stall the accept loop
            return
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name="exporter-http", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # cannot start a thread (resource limits): drop this connection only
            self._slots.release()
            self.close_request(request)

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            request.settimeout(self.header_timeout)
            # headers and body go out in separate writes: without NODELAY, Nagle and delayed ACKs add 40 ms
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                request = self._handshake(request)
            if request is not None:
                self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - one connection's failure must never reach the server
            self.handle_error(request, client_address)
        finally:
            if request is not None:
                self.shutdown_request(request)
            self._slots.release()

    def _handshake(self, sock: socket.socket) -> ssl.SSLSocket | None:
        """TLS handshake in this connection's thread; plain HTTP gets Go's 400 answer, then close."""
        try:
            first = sock.recv(8, socket.MSG_PEEK)
            if first and any(method.startswith(first) or first.startswith(method) for method in _HTTP_METHODS):
                sock.sendall(b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                             b"Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")
                self.shutdown_request(sock)
                return None
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            sock.do_handshake()
            return sock
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.debug("TLS handshake failed: %s", exc)
            self.shutdown_request(sock)
            return None

    def shutdown_request(self, request: socket.socket) -> None:
        """Lingering close: half-close, read what the client still sends (bounded), then close.

        Closing a socket with unread input makes the kernel send a reset, which can destroy an error
        reply (431, 400, ...) before the client has read it.
        """
        try:
            _drain(request)
        except OSError:
            pass
        self.close_request(request)

    def handle_error(self, request, client_address) -> None:
        log.debug("error serving %s", client_address[0], exc_info=True)


def _drain(sock: socket.socket, limit: int = 65536, seconds: float = 1.0) -> None:
    """Half-close, then read and drop what the client still sends: at most `limit` bytes and `seconds`."""
    sock.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + seconds
    while limit > 0 and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        chunk = sock.recv(min(limit, 65536))
        if not chunk:
            return
        limit -= len(chunk)


def _landing_page(path: str) -> bytes:
    link = html.escape(path, quote=True)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>dualtrack exporter</title></head>\n"
            f"<body><h1>dualtrack NVML exporter</h1>\n<ul><li><a href=\"{link}\">Metrics</a></li>\n"
            f"<li><a href=\"/-/healthy\">Health</a></li><li><a href=\"/-/ready\">Readiness</a></li></ul>\n"
            f"</body></html>\n").encode()


class WebServer:
    """Serve `registry` on the telemetry path, plus /-/healthy, /-/ready and a landing page.

    `render(accept_header) -> (body, content_type)`, when given, renders unfiltered scrapes (it must
    serve what `registry` holds); `name[]`-filtered scrapes always render `registry` with prometheus_client.
    The constructor checks the listen address (ValueError); start() binds and serves from daemon
    threads, raising OSError when the address cannot be bound; shutdown() stops serving.
    """

    def __init__(self, registry, *, listen_address: str, telemetry_path: str, web_config: WebConfig | None,
                 ready: Callable[[], bool], render: Render | None = None, header_timeout: float = HEADER_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, auth_cache: bool = True) -> None:
        try:
            self._host, self._port = parse_listen_address(listen_address)
            check_telemetry_path(telemetry_path)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        self._options = dict(registry=registry, render=render, telemetry_path=telemetry_path, web_config=web_config,
                             ready=ready, header_timeout=header_timeout, max_connections=max_connections,
                             auth_cache=auth_cache)
        self._server: _Server | None = None

    def start(self) -> None:
        """Bind the listen address and serve in a background daemon thread."""
        server = self._bind()
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                         name="exporter-http-accept", daemon=True).start()
        host, port = self.server_address
        log.info("serving on %s://%s:%d%s", "https" if server.ssl_context else "http",
                 f"[{host}]" if ":" in host else host, port, server.telemetry_path)

    def _bind(self) -> "_Server":
        """Bind; an empty host means "::" (IPv4 and IPv6), or all IPv4 addresses where IPv6 is off."""
        if self._host:
            candidates = [_resolve(self._host, self._port)]
        else:
            candidates = [(socket.AF_INET6, ("::", self._port)), (socket.AF_INET, ("", self._port))]
        error = OSError(f"cannot bind {self._host}:{self._port}")
        for family, address in candidates:
            server = None
            try:
                server = _Server(address, family, **self._options)
                server.server_bind()
                server.server_activate()
                return server
            except OSError as exc:
                error = exc
                if server is not None:
                    server.server_close()
                    server.renders.close()
        raise error

    def shutdown(self) -> None:
        """Stop accepting connections and close the listening socket (in-flight requests may finish)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.renders.close()
            self._server = None

    @property
    def server_address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("the server is not started")
        host, port = self._server.socket.getsockname()[:2]
        return host, port


def _resolve(host: str, port: int) -> tuple[int, tuple[str, int]]:
    """Address family and bind address of a named or numeric host."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve listen host {host!r}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr[:2]
