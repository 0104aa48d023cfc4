"""Loopback servers that answer HTTP as a broken or hostile Prometheus would, byte by byte: a body
trickled forever, one too large, a bad status line, a body cut short, a connection dropped."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable

#: What a well-formed, empty instant-vector answer looks like.
EMPTY_VECTOR = b'{"status":"success","data":{"resultType":"vector","result":[]}}'


class RawServer:
    """Serves each connection on 127.0.0.1 with `answer(connection, stop)` once the request's head
    is read (at once with `read_request=False`: a TLS client waits for the server to speak);
    `requests` holds the heads. A context manager: leaving it stops every answer."""

    def __init__(self, answer: Callable[[socket.socket, threading.Event], None], read_request: bool = True) -> None:
        self.answer = answer
        self.read_request = read_request
        self.requests: list[bytes] = []
        self.stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="hostile-http", daemon=True)

    def __enter__(self) -> RawServer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        with socket.create_connection(self._listener.getsockname()):  # wakes the accept at once
            pass
        self._thread.join()
        self._listener.close()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            if self.stop.is_set():
                connection.close()
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.settimeout(10)
                head = b""
                while self.read_request and b"\r\n\r\n" not in head and len(head) < 65536:
                    chunk = connection.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                self.requests.append(head)
                self.answer(connection, self.stop)
            except OSError:  # the client went away: nothing more to say
                pass


def response(status: int | bytes, body: bytes, headers: bytes = b"") -> bytes:
    """A status line (or raw bytes in its place), headers and body, with a true Content-Length."""
    line = status if isinstance(status, bytes) else f"HTTP/1.1 {status} Whatever\r\n".encode()
    return line + headers + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body


def trickle(connection: socket.socket, stop: threading.Event) -> None:
    """A 200 whose promised body comes one byte every 50 ms, for as long as the client listens."""
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
    while not stop.wait(0.05):
        connection.sendall(b" ")


def huge(connection: socket.socket, stop: threading.Event) -> None:
    """A well-formed empty answer padded to 40 MiB, with no Content-Length (it ends at the close)."""
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
    connection.sendall(EMPTY_VECTOR)
    pad = b" " * 2**20
    for _ in range(40):
        if stop.is_set():
            return
        connection.sendall(pad)


def declared_huge(connection: socket.socket, _stop: threading.Event) -> None:
    """A Content-Length of 1 TB (what follows is never read)."""
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n" + EMPTY_VECTOR)


def bad_status_line(connection: socket.socket, _stop: threading.Event) -> None:
    connection.sendall(b"SPAM \x1b[31mSPAM\r\n\r\n")


def truncated(connection: socket.socket, _stop: threading.Event) -> None:
    """A body cut short of its Content-Length, then the connection closed."""
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + EMPTY_VECTOR[:20])


def silent(_connection: socket.socket, stop: threading.Event) -> None:
    """The request is read, then nothing comes back until the server stops."""
    stop.wait()


def disconnect(connection: socket.socket, _stop: threading.Event) -> None:
    """No answer at all: the connection is closed."""


def empty_vector(connection: socket.socket, _stop: threading.Event) -> None:
    connection.sendall(response(200, EMPTY_VECTOR))
