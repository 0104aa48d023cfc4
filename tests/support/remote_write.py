"""A loopback remote-write receiver for the hook's tests: it decodes what it gets with protobuf and
cramjam (snappy block format) and answers what the test says."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cramjam

from trainer_hook.remote_write import messages


@dataclass
class Received:
    """One POST: its headers and the decoded series {labels: [(timestamp_ms, value), ...]}."""

    headers: dict[str, str]
    series: dict[tuple[tuple[str, str], ...], list[tuple[int, float]]] = field(default_factory=dict)
    raw_labels: list[list[tuple[str, str]]] = field(default_factory=list)  # as sent, in order


def decode(body: bytes) -> tuple[dict, list]:
    request = messages()["WriteRequest"]()
    request.ParseFromString(bytes(cramjam.snappy.decompress_raw(body)))
    series, raw = {}, []
    for timeseries in request.timeseries:
        labels = [(label.name, label.value) for label in timeseries.labels]
        raw.append(labels)
        series[tuple(labels)] = [(sample.timestamp, sample.value) for sample in timeseries.samples]
    return series, raw


@contextlib.contextmanager
def receiver(respond: Callable[[Received], int | tuple] = lambda _: 204
             ) -> Iterator[tuple[str, list[Received]]]:
    """Yields (URL, the requests received so far); `respond(request)` gives each one's status, or
    (status, body), or (status, body, headers) (it may block, as a hung receiver)."""
    got: list[Received] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            series, raw = decode(body)
            request = Received(dict(self.headers), series, raw)
            with lock:
                got.append(request)
            answer = respond(request)
            status, text, *headers = answer if isinstance(answer, tuple) else (answer, b"")
            self.send_response(status)
            for name, value in (headers[0] if headers else {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/api/v1/write", got
    finally:
        server.shutdown()
        server.server_close()
