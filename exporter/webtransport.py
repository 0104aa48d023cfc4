"""The exporter's HTTP transport: connections, slow clients, the connection cap and the TLS handshake.

Built on `http.server` with one daemon thread per connection. Hostile clients are bounded:
- a connection must deliver a complete request head within HEADER_TIMEOUT seconds in total, counted
  from accept (the TLS handshake included) and then from the end of each reply (a slowloris client
  trickling one byte a second, or one that stalls its handshake, is cut off), and the head may not
  exceed MAX_HEADER_BYTES;
- at most MAX_CONNECTIONS connections are open at once, at most MAX_CONNECTIONS_PER_CLIENT from one
  source address. Past either cap a new connection takes the slot of a connection still waiting for
  its request head (idle, mid-handshake or trickling): the longest waiting one of the client holding
  the most connections (past the per-client cap: of the same client). Only when every slot is busy
  serving a request is the new connection closed. So idle sockets, from one address or several, never
  keep a new client out;
- the TLS handshake runs in the connection's thread, so a slow handshake never blocks `accept`.
No request can stop the server: every error is confined to its connection. A plain-HTTP request to the TLS
port gets the answer Go's net/http gives (and so every exporter-toolkit exporter): 400 "Client sent
an HTTP request to an HTTPS server."
"""
from __future__ import annotations

import http.client
import io
import logging
import socket
import socketserver
import ssl
import threading
import time
from collections import Counter
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Mapping

HEADER_TIMEOUT = 10.0
MAX_HEADER_BYTES = 96 * 1024  # the request line alone may be 64 KiB, as http.server allows
MAX_CONNECTIONS = 128
MAX_CONNECTIONS_PER_CLIENT = MAX_CONNECTIONS // 2  # above 50: the load test's keep-alive scrapers share one address
_HTTP_METHODS = (b"GET ", b"HEAD ", b"POST ", b"PUT ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")

log = logging.getLogger("exporter.web")


class _Connection:
    """An open connection as the slot accounting sees it."""

    def __init__(self, client: str, sock: socket.socket) -> None:
        self.client = client
        # A second descriptor of the socket: shutting it down from the accept thread wakes the
        # connection's thread wherever it blocks (TLS replaces the socket object it reads from).
        self._handle = sock.dup()
        self.accepted = time.monotonic()
        # Since when it waits for a request head (monotonic), or None while a request is served.
        self.waiting_since: float | None = self.accepted

    def evict(self) -> None:
        """Cut the connection: its thread sees the end of the stream and finishes."""
        try:
            self._handle.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        self._handle.close()


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


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler whose request heads are read under a total deadline and a byte budget."""

    server: "Server"
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # so that even a garbage request line gets a status line back
    error_message_format = "%(code)d %(message)s\n"
    error_content_type = "text/plain; charset=utf-8"

    def __init__(self, request: socket.socket, client_address, server: "Server", connection: _Connection) -> None:
        self.slot = connection
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced below; closing releases its reference on the socket
        self._head = _HeadReader(self.connection, self.server.header_timeout)
        self.rfile = io.BufferedReader(self._head)

    def handle_one_request(self) -> None:
        if self.slot.waiting_since is None:  # the next request on a kept-alive connection
            self.slot.waiting_since = time.monotonic()
        self._head.deadline = self.slot.waiting_since + self.server.header_timeout
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
        self.slot.waiting_since = None
        return ok

    def end_headers(self) -> None:
        for name, value in self.server.extra_headers.items():
            self.send_header(name, value)
        super().end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with connection caps, per-connection TLS handshake and quiet errors."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], family: int, handler: type[BoundedHandler], *,
                 ssl_context: ssl.SSLContext | None, extra_headers: Mapping[str, str], header_timeout: float,
                 max_connections: int, max_connections_per_client: int) -> None:
        self.address_family = family
        super().__init__(address, handler, bind_and_activate=False)
        self.ssl_context = ssl_context
        self.extra_headers = dict(extra_headers)
        self.header_timeout = header_timeout
        self._max_connections = max_connections
        self._max_per_client = max_connections_per_client
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        self._limit_logged = -1e9

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # ":port" = IPv4 and IPv6
        socketserver.TCPServer.server_bind(self)  # skip HTTPServer's getfqdn(): a DNS lookup at start-up
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: socket.socket, client_address) -> None:
        try:
            connection = self._admit(client_address[0], request)
        except OSError:  # no descriptor left for the connection's handle
            connection = None
        if connection is None:
            self._log_full(f"no slot free (each is serving a request): closing a new connection from {client_address[0]}")
            self.close_request(request)  # at once: draining here would stall the accept loop
            return
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address, connection),
                                  name="exporter-http", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # cannot start a thread (resource limits): drop this connection only
            self._release(connection)
            self.close_request(request)

    def _admit(self, client: str, request: socket.socket) -> _Connection | None:
        """A slot for a new connection from `client`, evicting a waiting connection past a cap; None if all serve."""
        with self._lock:
            mine = [connection for connection in self._connections if connection.client == client]
            if len(mine) >= self._max_per_client:
                full = mine
            elif len(self._connections) >= self._max_connections:
                full = self._connections
            else:
                full = None
            if full is not None:
                victim = self._longest_waiting(full)
                if victim is None:
                    return None
                self._connections.remove(victim)
                victim.evict()
                self._log_full(f"connection slots full: closing a waiting connection from {victim.client} "
                               f"for a new one from {client}")
            connection = _Connection(client, request)
            self._connections.append(connection)
            return connection

    def _longest_waiting(self, candidates: list[_Connection]) -> _Connection | None:
        """The connection waiting longest for a request head, of the client holding the most connections."""
        held = Counter(connection.client for connection in self._connections)
        waiting = [(connection, since) for connection in candidates if (since := connection.waiting_since) is not None]
        if not waiting:
            return None
        return max(waiting, key=lambda pair: (held[pair[0].client], -pair[1]))[0]

    def _release(self, connection: _Connection) -> None:
        with self._lock:
            if connection in self._connections:
                self._connections.remove(connection)
        connection.close()

    def _log_full(self, message: str) -> None:
        if time.monotonic() - self._limit_logged > 60:  # once a minute: an attack must not flood the log
            self._limit_logged = time.monotonic()
            log.warning("%s (at most %d connections, %d per client)", message, self._max_connections,
                        self._max_per_client)

    def process_request_thread(self, request: socket.socket, client_address, connection: _Connection) -> None:
        try:
            # headers and body go out in separate writes: without NODELAY, Nagle and delayed ACKs add 40 ms
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                request = self._handshake(request, connection)
            if request is not None:
                request.settimeout(self.header_timeout)
                self.RequestHandlerClass(request, client_address, self, connection)
        except Exception:  # noqa: BLE001 - one connection's failure must never reach the server
            self.handle_error(request, client_address)
        finally:
            if request is not None:
                self.shutdown_request(request)
            self._release(connection)

    def _handshake(self, sock: socket.socket, connection: _Connection) -> ssl.SSLSocket | None:
        """TLS handshake in this connection's thread; plain HTTP gets Go's 400 answer, then close.

        The head's deadline, counted from accept, bounds it: the socket timeout is the handshake's
        total duration (Python 3.5+), not a limit per read.
        """
        deadline = connection.accepted + self.header_timeout
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            first = sock.recv(8, socket.MSG_PEEK)
            if first and any(method.startswith(first) or first.startswith(method) for method in _HTTP_METHODS):
                sock.sendall(b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                             b"Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")
                self.shutdown_request(sock)
                return None
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
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


def bind(host: str, port: int, make: Callable[[tuple[str, int], int], Server]) -> Server:
    """`make(address, family)` bound and listening; an empty host means "::" (IPv4 and IPv6), or all
    IPv4 addresses where IPv6 is off. Raises OSError when no candidate address can be bound."""
    if host:
        candidates = [_resolve(host, port)]
    else:
        candidates = [(socket.AF_INET6, ("::", port)), (socket.AF_INET, ("", port))]
    error = OSError(f"cannot bind {host}:{port}")
    for family, address in candidates:
        server = None
        try:
            server = make(address, family)
            server.server_bind()
            server.server_activate()
            return server
        except OSError as exc:
            error = exc
            if server is not None:
                server.server_close()
    raise error


def _resolve(host: str, port: int) -> tuple[int, tuple[str, int]]:
    """Address family and bind address of a named or numeric host."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve listen host {host!r}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr[:2]
