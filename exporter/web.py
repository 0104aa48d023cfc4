"""The exporter's HTTP endpoints: the telemetry path, health/readiness probes and the landing page.

`WebServer` puts them together: the transport (`webtransport`: connections, slow clients, TLS),
authentication (`webauth`: basic auth, client certificate SANs) and the flags and landing page
(`webflags`). Concurrent scrapes share one rendering of the registry, done in a dedicated thread
(see _Renderer).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import gzip
import logging
import threading
from http import HTTPStatus
from typing import Callable
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder, gzip_accepted

from exporter.webauth import Authenticator, san_allowed
from exporter.webconfig import WebConfig
from exporter.webflags import check_telemetry_path, landing_page, parse_listen_address
from exporter.webtransport import (HEADER_TIMEOUT, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT, BoundedHandler, Server,
                                   bind)

RENDER_TIMEOUT = 10.0  # Prometheus' default scrape_timeout; rendering serves a snapshot and takes ms

# gzip's fastest level: a 60 KB exposition of 8 GPUs shrinks 9-fold in 0.13 ms (level 6: 10-fold in 0.56 ms)
GZIP_LEVEL = 1

log = logging.getLogger("exporter.web")
Render = Callable[[str | None], tuple[bytes, str]]  # Accept header -> (body, content type)


def render_registry(registry, accept: str | None) -> tuple[bytes, str]:
    """`registry` rendered by prometheus_client in the format an Accept header asks for, and its content type."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


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


class _Handler(BoundedHandler):
    server: "_Server"

    def version_string(self) -> str:
        return "dualtrack-exporter"

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
        if self.server.allowed_sans and not san_allowed(self.connection, self.server.allowed_sans):
            self._reply(HTTPStatus.FORBIDDEN, b"Forbidden\n")
            return False
        if self.server.authenticator and not self.server.authenticator.check(self.headers.get("Authorization")):
            self._reply(HTTPStatus.UNAUTHORIZED, b"Unauthorized\n",
                        extra={"WWW-Authenticate": 'Basic realm="dualtrack-exporter", charset="UTF-8"'})
            return False
        return True

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


class _Server(Server):
    """The transport's server with what the endpoints need: registry, renderer, auth, readiness."""

    def __init__(self, address: tuple[str, int], family: int, *, registry, render: Render | None,
                 telemetry_path: str, web_config: WebConfig | None, ready: Callable[[], bool], header_timeout: float,
                 max_connections: int, max_connections_per_client: int, auth_cache: bool) -> None:
        config = web_config or WebConfig()
        super().__init__(address, family, _Handler, ssl_context=config.ssl_context, extra_headers=config.headers,
                         header_timeout=header_timeout, max_connections=max_connections,
                         max_connections_per_client=max_connections_per_client)
        self.registry = registry
        self.render_all = render or functools.partial(render_registry, registry)
        self.telemetry_path = telemetry_path
        self.ready = ready
        self.allowed_sans = config.client_allowed_sans
        self.authenticator = Authenticator(dict(config.users), cache=auth_cache) if config.users else None
        self.landing_page = landing_page(telemetry_path)
        self.renders = _Renderer()

    def render(self, accept: str | None, names: tuple[str, ...], compress: bool) -> tuple[bytes, str]:
        if names and hasattr(self.registry, "restricted_registry"):  # filtered scrapes are rare: the generic way
            body, content_type = render_registry(self.registry.restricted_registry(names), accept)
        else:
            body, content_type = self.render_all(accept)
        return gzip.compress(body, compresslevel=GZIP_LEVEL) if compress else body, content_type

    def is_ready(self) -> bool:
        try:
            return bool(self.ready())
        except Exception:  # noqa: BLE001 - a failing readiness callback means not ready
            log.exception("readiness check failed")
            return False

    def server_close(self) -> None:
        super().server_close()
        self.renders.close()


class WebServer:
    """Serve `registry` on the telemetry path, plus /-/healthy, /-/ready and a landing page.

    `render(accept_header) -> (body, content_type)`, when given, renders unfiltered scrapes (it must
    serve what `registry` holds); `name[]`-filtered scrapes always render `registry` with prometheus_client.
    The constructor checks the listen address (ValueError); start() binds and serves from daemon
    threads, raising OSError when the address cannot be bound; shutdown() stops serving.
    """

    def __init__(self, registry, *, listen_address: str, telemetry_path: str, web_config: WebConfig | None,
                 ready: Callable[[], bool], render: Render | None = None, header_timeout: float = HEADER_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
                 auth_cache: bool = True) -> None:
        try:
            self._host, self._port = parse_listen_address(listen_address)
            check_telemetry_path(telemetry_path)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        self._options = dict(registry=registry, render=render, telemetry_path=telemetry_path, web_config=web_config,
                             ready=ready, header_timeout=header_timeout, max_connections=max_connections,
                             max_connections_per_client=max_connections_per_client, auth_cache=auth_cache)
        self._server: _Server | None = None

    def start(self) -> None:
        """Bind the listen address and serve in a background daemon thread."""
        server = bind(self._host, self._port, lambda address, family: _Server(address, family, **self._options))
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
