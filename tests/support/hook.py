"""Shared pieces of the trainer_hook tests: a small real training loop and record readers."""
from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch.utils._python_dispatch import TorchDispatchMode

from stack import processes
from trainer_hook import TrainingMonitor


@dataclass
class Trainer:
    """A real (tiny) torch model trained with SGD on fixed random batches."""

    seed: int = 0
    model: torch.nn.Module = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    batches: list = field(init=False)
    step: int = 0

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.batches = [(torch.randn(64, 32), torch.randn(64, 1)) for _ in range(8)]

    def train_step(self, monitor: TrainingMonitor | None, loss_scale: float = 1.0,
                   batch_id: int | None = None) -> float:
        """One forward/backward/step; logs loss and grad norm; returns the step's wall time."""
        started = time.perf_counter()
        x, y = self.batches[self.step % len(self.batches)]
        loss = torch.nn.functional.mse_loss(self.model(x), y) * loss_scale
        self.optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if torch.isfinite(norm):
            self.optimizer.step()
        if monitor is not None:
            monitor.log({"loss": loss, "grad_norm": norm, "learning_rate": 0.01, "epoch": self.step // 100},
                        step=self.step, samples=64, batch_id=self.step if batch_id is None else batch_id)
        self.step += 1
        return time.perf_counter() - started


def run_id(prefix: str) -> str:
    """A run name unique to this test: `prefix` plus a random suffix."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def record_lines(path: Path) -> tuple[list[dict], list[dict]]:
    """(step lines, event lines) of a local record file."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [x for x in lines if "step" in x and "event" not in x], [x for x in lines if "event" in x]


def pushed_value(pushgateway_url: str, name: str, run: str, *, http: dict | None = None,
                 **labels: str) -> float | None:
    """A sample's value as the Pushgateway holds it for `run` (None if absent).

    `http`: extra arguments for requests.get (auth=, verify=) for a secured Pushgateway.
    """
    text = requests.get(pushgateway_url + "/metrics", timeout=5, **(http or {})).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("run") == run and \
                    all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def pulled(monitor: TrainingMonitor, name: str, **labels: str) -> float | None:
    """A sample's value as a pull-mode monitor serves it (None if absent)."""
    text = requests.get(f"http://127.0.0.1:{monitor.listen_port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def wait_pulled(monitor: TrainingMonitor, name: str, predicate: Callable[[float], bool],
                timeout: float = 10.0, **labels: str) -> float:
    def probe():
        value = pulled(monitor, name, **labels)
        return value is not None and predicate(value) and (value,)
    return processes.wait_until(probe, timeout, what=f"{name} served by the monitor")[0]


def wait_pushed(pushgateway_url: str, name: str, run: str, predicate: Callable[[float], bool],
                timeout: float = 15.0, *, http: dict | None = None, **labels: str) -> float:
    def probe():
        value = pushed_value(pushgateway_url, name, run, http=http, **labels)
        return value is not None and predicate(value) and (value,)
    return processes.wait_until(probe, timeout, what=f"{name} for run {run} on the Pushgateway")[0]


@contextlib.contextmanager
def http_gateway(respond: Callable[[BaseHTTPRequestHandler], int], body: bytes = b"", *,
                 date: bool = True, keep_alive: bool = False) -> Iterator[str]:
    """A local HTTP server standing in for a misbehaving Pushgateway; yields its URL.

    `respond(request)` runs for every push (it may block, e.g. to answer slowly) and returns the
    status code to answer with; GET requests are answered with `body`. `date=False` leaves out the
    `Date` header (as a proxy that drops it); `keep_alive` keeps connections open (HTTP/1.1), as the
    Pushgateway does.
    """
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

        def status(self, code: int) -> None:
            (self.send_response if date else self.send_response_only)(code)

        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.status(respond(self))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            self.status(respond(self))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class SyncCounter(TorchDispatchMode):
    """Counts device->host value reads (`aten._local_scalar_dense`: .item(), int(), float(), bool())
    made on the thread that enters it (dispatch modes are thread-local)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.ops: list[str] = []  # every aten op, by name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def pull_monitor(tmp_path: Path, job: str, **kwargs) -> TrainingMonitor:
    """A monitor that pushes nowhere and serves /metrics on a free port (read with pulled())."""
    kwargs.setdefault("run", "r1")
    kwargs.setdefault("pushgateway", False)
    kwargs.setdefault("record_path", tmp_path / "record.jsonl")
    kwargs.setdefault("push_interval", 0.1)
    kwargs.setdefault("listen_port", 0)
    return TrainingMonitor(job=job, **kwargs)


def live_stack(tmp_path: Path, start_service: Callable, *exporter_args: str) -> tuple:
    """(Pushgateway, simulated exporter, Prometheus with the shipped rules, scraping and evaluating
    every second), started with `start_service` (the conftest fixture, which stops them)."""
    pgw = start_service(processes.pushgateway(tmp_path))
    exporter = start_service(processes.exporter(tmp_path, [*exporter_args, "--sample-interval=0.2"]))
    config = processes.render_prometheus_config(
        tmp_path, {processes.EXPORTER_JOB: [exporter.address], processes.PUSHGATEWAY_JOB: [pgw.address]},
        scrape_interval="1s", evaluation_interval="1s")
    return pgw, exporter, start_service(processes.prometheus(tmp_path, config))


class Fp16Run:
    """A real mixed-precision loop: fp16 autocast on CPU with a GradScaler whose initial scale
    overflows the fp16 gradients, so it skips steps and backs off, then grows and overflows again."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=5)
        self.x, self.y = torch.randn(64, 32), torch.randn(64, 1)

    def step(self, loss_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(self.model(self.x).float(), self.y) * loss_factor
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach(), norm
