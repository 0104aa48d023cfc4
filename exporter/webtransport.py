"""The exporter's HTTP transport: HTTP/1.1 requests, connections, slow clients, the connection cap and TLS.

A small HTTP/1.1 server on `socketserver` with one daemon thread per connection (not `http.server`,
whose request parsing loads `http.client` and the `email` package: a few MB of resident memory for
reading a handful of header lines). What it serves:
- GET and HEAD (the handler answers anything else 405 with `Allow: GET, HEAD`); keep-alive for
  HTTP/1.1 unless `Connection: close`, close for HTTP/1.0 unless `Connection: keep-alive`; a request
  announcing a body (which is never read) closes its connection after the reply; pipelined requests
  are answered in order. Every reply carries `Server`, `Date`, `Content-Type`, `Content-Length` and the
  web config's extra headers (a reply to HEAD no body, whatever its status; one kept alive for HTTP/1.0
  says `Connection: keep-alive`); errors close the connection (`Connection: close`).
- Request heads are parsed by h11 (sans-I/O; this module does the I/O, deadlines and byte budgets),
  which refuses, as Go's net/http does (exporter-toolkit v0.17.1 serves with it), with 400: a request
  line that is not `METHOD TARGET HTTP/d.d` (HTTP/0.9's two-word lines included), a target with a
  byte outside visible ASCII, a header line without a colon, an HTTP/1.1 request without exactly one
  `Host`, a Content-Length that is not one number; a Transfer-Encoding other than chunked is 501.
  On top of h11, as Go: an HTTP major version other than 1 is 505, a header folded onto the previous
  line (which h11 would unfold) or a header value with a control character other than a tab is 400,
  and a plain-HTTP request to the TLS port gets 400 "Client sent an HTTP request to an HTTPS server.".
  As `http.server` (which served before): a request line over 64 KiB is 414, a header line over 64 KiB
  or more than 100 headers is 431. Leading empty lines before a request line are skipped.
Hostile clients are bounded:
- a connection must deliver a complete request head within HEADER_TIMEOUT seconds in total, counted
  from accept (the TLS handshake included), and on a kept-alive connection from the first byte of each
  next request, which may come up to KEEPALIVE_TIMEOUT after the reply (a slowloris client trickling
  one byte a second, or one that stalls its handshake, is cut off); the head may not exceed
  MAX_HEADER_BYTES (431);
- at most MAX_CONNECTIONS connections are open at once, at most MAX_CONNECTIONS_PER_CLIENT from one
  source address. Past either cap a new connection takes the slot of a connection still waiting for
  its request head (idle, mid-handshake or trickling): the longest waiting one of the client holding
  the most connections (past the per-client cap: of the same client). A connection whose client has
  not read a reply for STALLED_WRITE seconds waits on its client too. Only when every slot is busy
  serving a request is the new connection closed. So idle sockets, and clients that send requests but
  never read the replies, from one address or several, never keep a new client out;
- the TLS handshake runs in the connection's thread, so a slow handshake never blocks `accept`;
- connections end with a lingering close, so that a client still sending never destroys its reply.
No request can stop the server: every error is confined to its connection. `ssl` is never imported
here: a TLS context comes from the web config, which imports it only when it asks for TLS.
"""
from __future__ import annotations

import contextlib
import logging
import re
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import h11

if TYPE_CHECKING:
    import ssl

HEADER_TIMEOUT = 10.0
#: How long a kept-alive connection may wait for the first byte of its next request: past the usual
#: scrape intervals (15 s to 1 min), so that a scraper's connection, and its TLS session, is reused.
KEEPALIVE_TIMEOUT = 120.0
#: A reply blocked this long on a client that does not read makes its connection evictable.
STALLED_WRITE = 1.0
MAX_HEADER_BYTES = 96 * 1024  # the request line alone may be 64 KiB, as http.server allows
MAX_LINE_BYTES = 64 * 1024
MAX_HEADERS = 100
MAX_CONNECTIONS = 128
MAX_CONNECTIONS_PER_CLIENT = MAX_CONNECTIONS // 2  # above 50: the load test's keep-alive scrapers share one address
_HTTP_METHODS = (b"GET ", b"HEAD ", b"POST ", b"PUT ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")
# Read a request head in pieces of this size: recv(n) allocates n bytes first, in the connection thread's
# malloc arena (a head is a few hundred bytes; Python's http.server read through an 8 KiB buffer too).
_READ_BYTES = 8192
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_FOLDED = re.compile(rb"\n[ \t]")  # obs-fold (RFC 9112 5.2): a line of the head starting with white space
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # in a header value: all but HTAB (RFC 9110 5.5)
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")

log = logging.getLogger("exporter.web")
_S = TypeVar("_S", bound="Server")


class Request(NamedTuple):
    """A request head: method, target (path and query), HTTP version and headers by lower-case name
    (a repeated header's values joined by ", ")."""

    method: str
    target: str
    version: tuple[int, int]
    headers: dict[str, str]


class _Refused(Exception):
    """A request head that gets an error reply and closes the connection."""

    def __init__(self, status: HTTPStatus) -> None:
        super().__init__(status.phrase)
        self.status = status


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
        # Since when a reply is being written (monotonic), or None.
        self.writing_since: float | None = None

    def waits_on_client(self, now: float) -> float | None:
        """Since when the connection waits on its client: for a request head, or to read a reply blocked
        for STALLED_WRITE seconds (a client that sends requests but never reads); None while serving."""
        if self.waiting_since is not None:
            return self.waiting_since
        writing = self.writing_since
        return writing if writing is not None and now - writing >= STALLED_WRITE else None

    def evict(self) -> None:
        """Cut the connection: its thread sees the end of the stream and finishes."""
        try:
            self._handle.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        self._handle.close()


def http_date(seconds: float | None = None) -> str:
    """An HTTP date (RFC 9110 IMF-fixdate), English whatever the locale: "Sun, 06 Nov 1994 08:49:37 GMT"."""
    t = time.gmtime(seconds)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


def parse_head(head: bytes) -> Request:
    """A request head (up to its empty line, none before it) parsed by h11, as a Request; raises _Refused
    with the status to answer."""
    if _FOLDED.search(head):
        raise _Refused(HTTPStatus.BAD_REQUEST)
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
    parser.receive_data(head)
    try:
        event = parser.next_event()
    except h11.RemoteProtocolError as exc:
        raise _Refused(HTTPStatus(exc.error_status_hint)) from None
    if not isinstance(event, h11.Request):  # a whole head is one Request: never NEED_DATA here
        raise _Refused(HTTPStatus.BAD_REQUEST)
    if not event.http_version.startswith(b"1."):
        raise _Refused(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED)
    if len(event.headers) > MAX_HEADERS or any(len(name) + len(value) > MAX_LINE_BYTES
                                               for name, value in event.headers):
        raise _Refused(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
    headers: dict[str, str] = {}
    for name, value in event.headers:  # names lower-cased by h11, values stripped of white space around
        if _CONTROL.search(value):
            raise _Refused(HTTPStatus.BAD_REQUEST)
        key, text = name.decode("ascii"), value.decode("iso-8859-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return Request(event.method.decode("ascii"), event.target.decode("ascii"), (1, int(event.http_version[2:])),
                   headers)


def _keeps_alive(request: Request) -> bool:
    """Whether the connection stays open after the reply to `request`."""
    tokens = {token.strip().lower() for token in request.headers.get("connection", "").split(",")}
    if "close" in tokens or "content-length" in request.headers and request.headers["content-length"].strip() != "0" \
            or "transfer-encoding" in request.headers:
        return False  # a body is never read: the next request could not be found after it
    return request.version >= (1, 1) or "keep-alive" in tokens


class BoundedHandler:
    """Serves one connection: reads request heads under a total deadline and a byte budget, hands each to
    `respond` (defined by a subclass, which answers with `reply`), and closes after an error."""

    server: Server
    server_version = "dualtrack-exporter"

    def __init__(self, sock: socket.socket, client_address, server: Server, connection: _Connection) -> None:
        self.connection = sock
        self.client_address = client_address
        self.server = server
        self.slot = connection
        self.close_connection = True
        self.served = False  # a request was answered: the connection is kept alive for the next
        self.head_request = False  # the request being answered is a HEAD: replies carry no body
        self.keep_alive_announced = False  # HTTP/1.0 asked for keep-alive: replies say so
        self._buffer = bytearray()  # appended in place: a head trickled byte by byte is not copied over and over
        self.handle()

    def respond(self, request: Request) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def waiting_on_server(self) -> Iterator[None]:
        """While inside, the connection may be evicted for a new one, as one waiting on its client may: for
        waits that only a flood makes long (a password check queued behind others' for bcrypt)."""
        self.slot.waiting_since = time.monotonic()
        try:
            yield
        finally:
            self.slot.waiting_since = None

    def handle(self) -> None:
        while True:
            try:
                head = self._read_head()
                if head is None:
                    return
                request = parse_head(head)
            except _Refused as refused:
                self.close_connection, self.head_request = True, False
                self.reply(refused.status, f"{refused.status.value} {refused.status.phrase}\n".encode())
                return
            finally:
                self.slot.waiting_since = None
                self.connection.settimeout(self.server.header_timeout)  # for writing the reply
            self.close_connection = not _keeps_alive(request)
            self.head_request = request.method == "HEAD"
            self.keep_alive_announced = request.version < (1, 1) and not self.close_connection
            log.debug("%s %s %s", self.client_address[0], request.method, request.target[:200])
            self.respond(request)
            if self.close_connection:
                return
            self.served = True
            self.slot.waiting_since = time.monotonic()

    def _read_head(self) -> bytes | None:
        """The next request head, read by the head's deadline; None when the connection ends (or times
        out) first; raises _Refused when it is too large. A kept-alive connection may wait
        KEEPALIVE_TIMEOUT for the request's first byte; the head's deadline runs from then."""
        kept_alive = self.served and not self._buffer
        timeout = self.server.keepalive_timeout if kept_alive else self.server.header_timeout
        since = self.slot.waiting_since  # set while a head is awaited; None only while serving
        deadline = (time.monotonic() if since is None else since) + timeout
        searched = 0
        while True:
            if self._buffer[:1] in (b"\r", b"\n"):  # empty lines before a request line are skipped (RFC 9112 2.2)
                del self._buffer[:len(self._buffer) - len(self._buffer.lstrip(b"\r\n"))]
            if len(self._buffer) > MAX_LINE_BYTES and self._buffer.find(b"\n", 0, MAX_LINE_BYTES + 1) < 0:
                raise _Refused(HTTPStatus.REQUEST_URI_TOO_LONG)
            if end := _HEAD_END.search(self._buffer, searched):
                break
            searched = max(0, len(self._buffer) - 3)
            if len(self._buffer) >= MAX_HEADER_BYTES:
                raise _Refused(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
            left = deadline - time.monotonic()
            if left <= 0:
                return None  # slow client: cut off
            self.connection.settimeout(left)
            try:
                chunk = self.connection.recv(min(_READ_BYTES, MAX_HEADER_BYTES - len(self._buffer)))
            except (TimeoutError, OSError):
                return None
            if not chunk:
                return None
            if kept_alive and not self._buffer:  # the first byte of the next request: the head's deadline
                deadline = min(deadline, time.monotonic() + self.server.header_timeout)
            self._buffer += chunk
        head = bytes(self._buffer[:end.end()])
        del self._buffer[:end.end()]
        return head

    def reply(self, status: HTTPStatus, body: bytes, content_type: str = "text/plain; charset=utf-8",
              extra: Mapping[str, str] | None = None) -> None:
        """Send a reply (its headers only to a HEAD request). A client that does not read it makes its
        connection evictable after STALLED_WRITE seconds."""
        lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Server: {self.server_version}",
                 f"Date: {http_date()}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for headers in (extra or {}, self.server.extra_headers)
                  for name, value in headers.items()]
        if self.close_connection:
            lines.append("Connection: close")
        elif self.keep_alive_announced:
            lines.append("Connection: keep-alive")
        self.slot.writing_since = time.monotonic()
        try:
            self.connection.sendall("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n")
            if body and not self.head_request:  # not joined to the headers: a copy of the body in each connection's
                self.connection.sendall(body)  # thread would grow that thread's malloc arena (TCP_NODELAY is set)
        finally:
            self.slot.writing_since = None


class Server(socketserver.TCPServer):
    """A TCP server with connection caps, per-connection threads and TLS handshakes, and quiet errors."""

    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], family: int, handler: type[BoundedHandler], *,
                 ssl_context: ssl.SSLContext | None, extra_headers: Mapping[str, str], header_timeout: float,
                 max_connections: int, max_connections_per_client: int,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT) -> None:
        self.address_family = family
        # socketserver's handler class stays unused: process_request starts `handler` with the connection's slot
        super().__init__(address, socketserver.BaseRequestHandler, bind_and_activate=False)
        self.handler = handler
        self.ssl_context = ssl_context
        self.extra_headers = dict(extra_headers)
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self._max_connections = max_connections
        self._max_per_client = max_connections_per_client
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        self._limit_logged = -1e9

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # ":port" = IPv4 and IPv6
        super().server_bind()

    def process_request(self, request: socket.socket, client_address) -> None:  # type: ignore[override] # TCP: a socket
        try:
            connection = self._admit(client_address[0], request)
        except OSError:  # no descriptor left for the connection's handle
            connection = None
        if connection is None:
            self._log_full("no slot free (each is serving a request): closing a new connection from "
                           f"{client_address[0]}")
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
        """The connection waiting longest on its client (`waits_on_client`), of the client holding the most
        connections."""
        held = Counter(connection.client for connection in self._connections)
        now = time.monotonic()
        waiting = [(connection, since) for connection in candidates
                   if (since := connection.waits_on_client(now)) is not None]
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
        sock: socket.socket | None = request  # None once a failed handshake has closed it
        try:
            # headers and body go out in separate writes: without NODELAY, Nagle and delayed ACKs add 40 ms
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self._handshake(request, connection, self.ssl_context)
            if sock is not None:
                sock.settimeout(self.header_timeout)
                self.handler(sock, client_address, self, connection)
        except Exception:  # noqa: BLE001 - one connection's failure must never reach the server
            self.handle_error(sock, client_address)
        finally:
            if sock is not None:
                self.shutdown_request(sock)
            self._release(connection)

    def _handshake(self, sock: socket.socket, connection: _Connection, context: ssl.SSLContext
                   ) -> ssl.SSLSocket | None:
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
            sock = tls = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)  # (closed below)
            tls.settimeout(max(0.001, deadline - time.monotonic()))
            tls.do_handshake()
            return tls
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.debug("TLS handshake failed: %s", exc)
            self.shutdown_request(sock)
            return None

    def server_close(self) -> None:
        """Close the listening socket and the connections waiting on their clients (a kept-alive one would
        linger up to KEEPALIVE_TIMEOUT); requests being served finish."""
        super().server_close()
        now = time.monotonic()
        with self._lock:
            waiting = [connection for connection in self._connections if connection.waits_on_client(now) is not None]
            for connection in waiting:
                self._connections.remove(connection)
        for connection in waiting:
            connection.evict()

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override] # TCP: a socket
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


def bind(host: str, port: int, make: Callable[[tuple[str, int], int], _S]) -> _S:
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
    return family, (str(sockaddr[0]), int(sockaddr[1]))
