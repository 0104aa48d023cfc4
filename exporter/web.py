"""The exporter's HTTP endpoints: the telemetry path, health/readiness probes and the landing page.

`WebServer` puts them together: the transport (`webtransport`: HTTP/1.1, connections, slow clients,
TLS), authentication (`webauth`: basic auth, client certificate SANs) and the flags and landing page
(`webflags`). Concurrent scrapes share one rendering, done in a dedicated thread (see _Renderer).
Nothing here imports prometheus_client, `ssl` or `hashlib`: the web config loads `ssl` when it asks
for TLS, the authenticator `hashlib` and bcrypt when it has users, and a server given a bare
prometheus_client registry renders it with prometheus_client.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from http import HTTPStatus
from urllib.parse import parse_qs, unquote, urlsplit

from exporter.exposition import render_registry
from exporter.textformat import gzip_accepted
from exporter.webauth import Authenticator, san_allowed
from exporter.webconfig import WebConfig
from exporter.webflags import check_telemetry_path, landing_page, parse_listen_address
from exporter.webtransport import (
    HEADER_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_CLIENT,
    BoundedHandler,
    Request,
    Server,
    bind,
)

RENDER_TIMEOUT = 10.0  # Prometheus' default scrape_timeout; rendering serves a snapshot and takes ms

log = logging.getLogger("exporter.web")
# (Accept header, name[] filter, gzip) -> (body, gzipped when asked; content type)
Render = Callable[[str | None, Sequence[str], bool], tuple[bytes, str]]
Reused = Callable[[str | None, Sequence[str], bool], tuple[bytes, str] | None]  # the same, or None: render it


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
            if call is None:
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


class _Handler(BoundedHandler):
    server: _Server

    def respond(self, request: Request) -> None:
        if not self._authorized(request):
            return
        if request.method not in ("GET", "HEAD"):
            self.close_connection = True  # a request body, if any, is left unread
            self.reply(HTTPStatus.METHOD_NOT_ALLOWED, b"Method Not Allowed\n", extra={"Allow": "GET, HEAD"})
            return
        try:
            url = urlsplit(request.target)
            path, params = unquote(url.path), parse_qs(url.query)  # "/%2D/healthy" is "/-/healthy", as in Go
        except ValueError:  # "http://[/metrics"
            self.close_connection = True
            self.reply(HTTPStatus.BAD_REQUEST, b"400 Bad Request\n")
            return
        if path == self.server.telemetry_path:
            self._metrics(request, params)
        elif path == "/-/healthy":
            self.reply(HTTPStatus.OK, b"Healthy\n")
        elif path == "/-/ready":
            ready = self.server.is_ready()
            self.reply(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                       b"Ready\n" if ready else b"Not ready\n")
        elif path == "/":
            self.reply(HTTPStatus.OK, self.server.landing_page, "text/html; charset=utf-8")
        else:
            self.reply(HTTPStatus.NOT_FOUND, b"Not Found\n")

    def _authorized(self, request: Request) -> bool:
        """Check client SANs and basic auth; on failure send the error reply and return False."""
        if self.server.allowed_sans and not san_allowed(self.connection, self.server.allowed_sans):
            self.reply(HTTPStatus.FORBIDDEN, b"Forbidden\n")
            return False
        if self.server.authenticator and not self.server.authenticator.check(
                request.headers.get("authorization"), self.client_address[0], self.waiting_on_server):
            self.close_connection = True  # a guesser reconnects: its next try waits for a slot like anyone's
            self.reply(HTTPStatus.UNAUTHORIZED, b"Unauthorized\n",
                       extra={"WWW-Authenticate": 'Basic realm="dualtrack-exporter", charset="UTF-8"'})
            return False
        return True

    def _metrics(self, request: Request, params: dict[str, list[str]]) -> None:
        accept = request.headers.get("accept")
        names = tuple(sorted(params.get("name[]", ())))
        gzipped = gzip_accepted(request.headers.get("accept-encoding"))
        try:
            reused = self.server.reused(accept, names, gzipped) if self.server.reused else None
            body, content_type = reused or self.server.renders.run((accept, names, gzipped),
                                                                   lambda: self.server.render(accept, names, gzipped))
        except Exception:  # a collector bug must not take the server down; the scrape reports 500
            log.exception("rendering metrics failed")
            self.reply(HTTPStatus.INTERNAL_SERVER_ERROR, b"error rendering metrics\n")
            return
        # The body depends on both headers: a cache in between must not hand it to another client.
        extra = {"Vary": "Accept, Accept-Encoding", **({"Content-Encoding": "gzip"} if gzipped else {})}
        self.reply(HTTPStatus.OK, body, content_type, extra=extra)


class _Server(Server):
    """The transport's server with what the endpoints need: registry, renderer, auth, readiness."""

    def __init__(self, address: tuple[str, int], family: int, *, registry, render: Render | None,
                 reused: Reused | None, telemetry_path: str, web_config: WebConfig | None, ready: Callable[[], bool],
                 header_timeout: float, max_connections: int, max_connections_per_client: int,
                 auth_cache: bool) -> None:
        config = web_config or WebConfig()
        super().__init__(address, family, _Handler, ssl_context=config.ssl_context, extra_headers=config.headers,
                         header_timeout=header_timeout, max_connections=max_connections,
                         max_connections_per_client=max_connections_per_client)
        self.render = render or functools.partial(render_registry, registry)
        self.reused = reused
        self.telemetry_path = telemetry_path
        self.ready = ready
        self.allowed_sans = config.client_allowed_sans
        self.authenticator = Authenticator(dict(config.users), cache=auth_cache) if config.users else None
        self.landing_page = landing_page(telemetry_path)
        self.renders = _Renderer()

    def is_ready(self) -> bool:
        try:
            return bool(self.ready())
        except Exception:  # a failing readiness callback means not ready
            log.exception("readiness check failed")
            return False

    def server_close(self) -> None:
        super().server_close()
        self.renders.close()


class WebServer:
    """Serve metrics on the telemetry path, plus /-/healthy, /-/ready and a landing page.

    `render(accept_header, names, gzipped) -> (body, content_type)` renders every scrape (`names`: the
    `name[]` filter; `gzipped`: the body gzipped); without it, `registry` (a prometheus_client
    collector or registry) is rendered by prometheus_client. `reused(accept_header, names, gzipped)`, when
    given, is tried first in the connection's thread: a body `render` rendered before and may serve
    again, or None.
    The constructor checks the listen address (ValueError); start() binds and serves from daemon
    threads, raising OSError when the address cannot be bound; shutdown() stops serving.
    """

    def __init__(self, registry=None, *, listen_address: str, telemetry_path: str, web_config: WebConfig | None,
                 ready: Callable[[], bool], render: Render | None = None, reused: Reused | None = None,
                 header_timeout: float = HEADER_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
                 auth_cache: bool = True) -> None:
        try:
            self._host, self._port = parse_listen_address(listen_address)
            check_telemetry_path(telemetry_path)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        self._options = {"registry": registry, "render": render, "reused": reused, "telemetry_path": telemetry_path,
                         "web_config": web_config, "ready": ready, "header_timeout": header_timeout,
                         "max_connections": max_connections, "max_connections_per_client": max_connections_per_client,
                         "auth_cache": auth_cache}
        self._server: _Server | None = None

    def start(self, before_serving: Callable[[], None] = lambda: None) -> None:
        """Bind the listen address, call `before_serving` (the CLI drops root there; what it raises closes
        the socket and propagates), then serve in a background daemon thread."""
        server = bind(self._host, self._port, lambda address, family: _Server(address, family, **self._options))
        try:
            before_serving()
        except BaseException:
            server.server_close()
            raise
        self._server = server
        # poll_interval: how late shutdown() is seen; each idle wake-up costs CPU (0.5 s woke twice as often)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 1.0},
                         name="exporter-http-accept", daemon=True).start()
        host, port = self.server_address
        log.info("serving on %s://%s:%d%s", "https" if server.ssl_context else "http",
                 f"[{host}]" if ":" in host else host, port, server.telemetry_path)

    def shutdown(self) -> None:
        """Stop accepting connections and close the listening socket (in-flight requests may finish)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def server_address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("the server is not started")
        host, port = self._server.socket.getsockname()[:2]
        return host, port
