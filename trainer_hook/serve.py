"""Pull mode's /metrics endpoint: a small bounded HTTP server in the training process.

One selector thread accepts connections and reads their request heads (TLS handshake included)
without blocking; a connection whose head is not complete within HEAD_DEADLINE seconds is closed,
and past MAX_CONNECTIONS waiting heads the oldest is closed for the newcomer, so clients that never
finish a request cost neither a thread nor a good scrape. A complete request goes to one of WORKERS
threads, which answers it (the answer written within WRITE_DEADLINE) and closes the connection (no
keep-alive). The process holds 1 + WORKERS threads for it however many clients connect.

TLS (a certificate and key) and basic auth (one user) are optional; a wrong or missing password gets
401. Standard library only.
"""
from __future__ import annotations

import base64
import hmac
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("trainer_hook")

#: Connections whose request head is still being read; past it the oldest is closed.
MAX_CONNECTIONS = 32
#: Threads that answer complete requests (requests past 2 per worker waiting are closed).
WORKERS = 2
#: Seconds a connection has to send its whole request head (TLS handshake included).
HEAD_DEADLINE = 5.0
#: Seconds an answer may take to be written.
WRITE_DEADLINE = 10.0
MAX_HEAD_BYTES = 8192
PATHS = ("/metrics", "/")


@dataclass
class _Pending:
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    handshaken: bool = False


class MetricsServer:
    """Serves `render()` (the exposition's bytes, with `content_type`) on GET /metrics until close()."""

    def __init__(self, address: str, port: int, render: Callable[[], bytes], content_type: str,
                 basic_auth: tuple[str, str] | None = None, tls: tuple[str, str] | None = None) -> None:
        """Raises OSError when the address cannot be bound, ValueError for unusable TLS files."""
        self._context: ssl.SSLContext | None = None
        if tls is not None:
            try:
                self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                self._context.load_cert_chain(*tls)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"cannot use the listen certificate and key: {exc}") from None
        self._render, self._content_type = render, content_type
        self._authorization = ("Basic " + base64.b64encode(":".join(basic_auth).encode()).decode()
                               if basic_auth else None)
        family, kind, _, _, bound = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        self._listener = socket.socket(family, kind)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(bound)
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._pending: dict[socket.socket, _Pending] = {}  # in arrival order: the oldest first
        self._ready: queue.Queue[tuple[socket.socket, bytes] | None] = queue.Queue(maxsize=2 * WORKERS)
        self._closing = False
        self._threads = [threading.Thread(target=self._loop, name="trainer_hook-listen", daemon=True)]
        self._threads += [threading.Thread(target=self._work, name="trainer_hook-listen-worker", daemon=True)
                          for _ in range(WORKERS)]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Stop accepting, close every connection, end the threads."""
        self._closing = True
        self._wake_write.send(b"x")
        self._threads[0].join(5)
        while True:  # requests not taken yet are not answered
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].close()
        for _ in range(WORKERS):
            self._ready.put(None)
        for thread in self._threads[1:]:
            thread.join(WRITE_DEADLINE)
        for sock in (*self._pending, self._listener, self._wake_read, self._wake_write):
            sock.close()
        self._selector.close()

    # ------------------------------------------------------------------ the selector thread
    def _loop(self) -> None:
        while not self._closing:
            for key, _ in self._selector.select(timeout=0.5):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is not self._wake_read:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for sock, pending in list(self._pending.items()):
                if pending.deadline > now:
                    break  # arrival order is deadline order
                self._drop(sock)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, a reset: try again at the next event
                return
            if len(self._pending) >= MAX_CONNECTIONS:
                self._drop(next(iter(self._pending)))
            sock.setblocking(False)
            if self._context is not None:
                sock = self._context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            self._pending[sock] = _Pending(time.monotonic() + HEAD_DEADLINE)
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        pending = self._pending.get(sock)
        if pending is None:
            return
        try:
            if self._context is not None and not pending.handshaken:
                sock.do_handshake()  # type: ignore[attr-defined]
                pending.handshaken = True
            while b"\r\n\r\n" not in pending.head:
                data = sock.recv(4096)
                if not data or len(pending.head) + len(data) > MAX_HEAD_BYTES:
                    self._drop(sock)
                    return
                pending.head += data
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
            return
        except BlockingIOError:
            return
        except OSError:  # ssl.SSLError included: a client that is not speaking TLS, a reset
            self._drop(sock)
            return
        self._selector.unregister(sock)
        del self._pending[sock]
        try:
            self._ready.put_nowait((sock, bytes(pending.head)))
        except queue.Full:  # every worker busy and the waiting room full: the client retries later
            sock.close()

    def _drop(self, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    # ------------------------------------------------------------------ the workers
    def _work(self) -> None:
        while (item := self._ready.get()) is not None:
            sock, head = item
            try:
                self._send(sock, self._answer(head))
            except Exception:  # a scrape gone wrong must not end serving
                log.debug("pull mode: answering a scrape failed", exc_info=True)
            finally:
                sock.close()

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        headers = {name.strip().lower(): value.strip()
                   for name, _, value in (line.partition(":") for line in lines[1:] if ":" in line)}
        if method not in ("GET", "HEAD"):
            return _response(405, b"method not allowed\n", "text/plain", ["Allow: GET, HEAD"])
        if path not in PATHS:
            return _response(404, b"not found: scrape /metrics\n", "text/plain")
        if self._authorization is not None and not hmac.compare_digest(
                headers.get("authorization", "").encode(), self._authorization.encode()):
            return _response(401, b"unauthorized\n", "text/plain", ['WWW-Authenticate: Basic realm="dualtrack"'])
        body = self._render()
        return _response(200, b"" if method == "HEAD" else body, self._content_type, length=len(body))

    @staticmethod
    def _send(sock: socket.socket, data: bytes) -> None:
        sock.setblocking(True)
        deadline = time.monotonic() + WRITE_DEADLINE
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            sent = sock.send(view[:65536])
            view = view[sent:]


def _response(status: int, body: bytes, content_type: str, extra: list[str] | None = None,
              length: int | None = None) -> bytes:
    reason = {200: "OK", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}[status]
    head = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}",
            f"Content-Length: {len(body) if length is None else length}", "Connection: close", *(extra or [])]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
