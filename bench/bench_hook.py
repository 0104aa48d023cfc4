"""trainer_hook benchmark: side-by-side figures from one run (`.venv/bin/python bench/bench_hook.py`).

1. log() on the calling thread against a baseline revision (`--baseline REV`, default the last
   release): Python floats and CPU 0-d tensors, 3, 30 and 300 keys (a fresh dict of fresh tensors per
   call), and two tensors and two numbers in a training loop; the same micro-benchmarks in
   alternating subprocesses, this tree's trainer_hook and REV's (`git archive`), so that load on a
   shared machine hits both alike (`--log-only`: this part only).
2. End-to-end overhead on a ~10 ms CPU training step: hook vs no hook, interleaved blocks.
3. grad_norm() vs the per-parameter .item() loop on a 192-tensor model, with sync counts.
4. Step time with the Pushgateway dead vs alive (a real prometheus-pushgateway), interleaved.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if "--worker" in sys.argv:  # the trainer_hook of the tree given, not this one's
    sys.path.insert(0, sys.argv[sys.argv.index("--worker") + 1])
else:
    sys.path.insert(0, str(REPO))

import torch

from stack import processes
from trainer_hook import TrainingMonitor, grad_norm

#: The last release's commit: what `--baseline` compares with unless told otherwise.
BASELINE = "1d94528"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: list[float]) -> float:
    return percentile(values, 0.5)


class StepModel:
    """A CPU MLP whose training step takes about `target` seconds on this machine."""

    def __init__(self, target: float = 0.010) -> None:
        torch.manual_seed(0)
        self.x, self.y = torch.randn(64, 256), torch.randn(64, 1)
        self.width = 256
        self._build()
        while median([self.step()[0] for _ in range(10)]) < target and self.width < 8192:
            self.width = int(self.width * 1.4)  # grow until ~target
            self._build()

    def _build(self) -> None:
        width = self.width
        self.model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(),
                                         torch.nn.Linear(width, width), torch.nn.ReLU(),
                                         torch.nn.Linear(width, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self) -> tuple[float, torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return time.perf_counter() - started, loss, norm


def paired_steps(model: StepModel, monitors: dict[str, TrainingMonitor | None],
                 steps: int) -> dict[str, list[float]]:
    """Per-step wall time (batch fetch + step + log) for each monitor (None: no hook), alternating
    step by step so that load changes on a shared machine hit every variant alike."""
    batches = {name: iter(range(steps)) if mon is None else mon.loader(range(steps))
               for name, mon in monitors.items()}
    times: dict[str, list[float]] = {name: [] for name in monitors}
    for _ in range(steps):
        for name, mon in monitors.items():
            started = time.perf_counter()
            batch_id = next(batches[name])
            _, loss, norm = model.step()
            if mon is not None:
                mon.log({"loss": loss, "grad_norm": norm, "learning_rate": 1e-3, "epoch": 0},
                        step=batch_id, samples=64, batch_id=batch_id)
            times[name].append(time.perf_counter() - started)
    return times


def log_cases(calls: int) -> dict[str, float]:
    """Median log() time in microseconds per case, on one monitor whose Pushgateway is dead (a port
    nobody listens on: every push fails at once, the push thread keeps retrying). The mixed case runs
    inside a small CPU training loop, as log() does in practice (caches cold after the step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    floats: dict[str, Callable[[int], dict[str, Any]]] = {
        "3 floats": lambda step: {"loss": 0.5 + step, "grad_norm": 1.5, "learning_rate": 1e-3}}
    for count in (30, 300):
        floats[f"{count} floats"] = lambda step, count=count: {f"k{i}": 0.5 + i + step for i in range(count)}
        floats[f"{count} 0-d tensors"] = (
            lambda step, count=count: {f"k{i}": torch.tensor(0.5 + i + step) for i in range(count)})
    results = {}
    with tempfile.TemporaryDirectory() as tmp, \
            TrainingMonitor(job="bench", run="log", pushgateway=f"http://127.0.0.1:{processes.free_port()}",
                            push_interval=0.5, record_path=Path(tmp) / "log.jsonl") as monitor:
        for name, payload in floats.items():
            times = []
            for step in range(calls):
                values = payload(step)
                started = time.perf_counter()
                monitor.log(values, step=step, samples=32, batch_id=step)
                times.append(time.perf_counter() - started)
            results[name] = median(times) * 1e6
        times = []
        for step in range(calls // 4):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            started = time.perf_counter()
            monitor.log({"loss": loss, "grad_norm": norm, "learning_rate": 1e-3, "epoch": 0},
                        step=step, samples=32, batch_id=step)
            times.append(time.perf_counter() - started)
        results["2 tensors + 2 numbers, CPU loop"] = median(times) * 1e6
    return results


def baseline_tree(revision: str, into: Path) -> Path:
    """`revision` of this repository, unpacked under `into` (git archive)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"bench_hook: cannot archive {revision!r}: {archive.stderr.decode().strip()}")
    tree = into / "baseline"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def bench_against(revision: str, rounds: int, calls: int) -> list[tuple[str, str, str]]:
    """log_cases() for this tree and `revision`, alternating subprocesses `rounds` times each: the
    median over rounds of each round's median."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": REPO, revision: baseline_tree(revision, Path(tmp))}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(rounds):
            for name, tree in trees.items():
                command = [sys.executable, __file__, "--worker", str(tree), "--calls", str(calls)]
                out = subprocess.run(command, capture_output=True, text=True, check=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
                runs[name].append(json.loads(out.stdout.splitlines()[-1]))
    rows = []
    figures = {name: {case: median([run[case] for run in found]) for case in found[0]}
               for name, found in runs.items()}
    for case in figures["this tree"]:
        now, then = figures["this tree"][case], figures[revision][case]
        rows.append((f"log() call, {case}", f"median {now:.2f} us", f"{revision}: {then:.2f} us ({now / then:.2f}x)"))
    for name, found in figures.items():
        rows.append((f"30 0-d tensors / 30 floats, {name}", f"{found['30 0-d tensors'] / found['30 floats']:.2f}x",
                     f"median of {rounds} rounds x {calls} calls"))
    return rows


def bench_overhead(model: StepModel, record_dir: Path, pgw_url: str, steps: int):
    """Hook vs no hook, plus a second no-hook variant: their difference is the noise floor."""
    with TrainingMonitor(job="bench", run="overhead", pushgateway=pgw_url, push_interval=1.0,
                         record_path=record_dir / "overhead.jsonl") as monitor:
        times = paired_steps(model, {"plain": None, "hooked": monitor, "plain again": None}, steps)
    plain, hooked, again = (median(times[name]) for name in ("plain", "hooked", "plain again"))
    overhead = (hooked - plain) / plain * 100
    noise = (again - plain) / plain * 100
    return [("training step, no hook", f"median {plain * 1e3:.2f} ms",
             f"p99 {percentile(times['plain'], .99) * 1e3:.2f} ms"),
            ("training step, with hook", f"median {hooked * 1e3:.2f} ms",
             f"overhead {overhead:+.2f} % (target < 1 %)"),
            ("training step, no hook again (noise floor)", f"median {again * 1e3:.2f} ms",
             f"difference {noise:+.2f} %")]


@contextlib.contextmanager
def counting_item() -> Iterator[list[int]]:
    """Count Tensor.item() calls (each one is a device->host sync on a GPU)."""
    count = [0]
    original = torch.Tensor.item

    def item(self):
        count[0] += 1
        return original(self)

    torch.Tensor.item = item
    try:
        yield count
    finally:
        torch.Tensor.item = original


def bench_grad_norm(reps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(96)])  # 192 tensors
    params = list(model.parameters())
    for p in params:  # gradients of realistic magnitude (a deep random chain would give denormals)
        p.grad = torch.randn_like(p)

    def naive() -> float:  # the common blog loop: one norm and one .item() per parameter
        total = 0.0
        for p in params:
            total += p.grad.data.norm(2).item() ** 2
        return total ** 0.5

    def fused() -> float:  # over the same list (as watch() keeps it)
        return grad_norm(params).item()

    assert abs(naive() - fused()) < 1e-3 * fused()
    times = {"naive": [], "fused": []}
    for _ in range(max(1, reps // 50)):  # interleaved blocks of 50 calls
        for name, fn in (("naive", naive), ("fused", fused)):
            for _ in range(50):
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
    syncs = {}
    for name, fn in (("naive", naive), ("fused", fused)):
        with counting_item() as count:
            fn()
        syncs[name] = count[0]
    speedup = median(times["naive"]) / median(times["fused"])
    return [(f"grad norm, per-parameter .item() loop ({len(params)} tensors)",
             f"median {median(times['naive']) * 1e6:.0f} us", f"{syncs['naive']} syncs"),
            ("grad norm, grad_norm() (fused, one read)", f"median {median(times['fused']) * 1e6:.0f} us",
             f"{syncs['fused']} sync; {speedup:.2f}x faster (target >= 1.8x)")]


def bench_dead_vs_alive(model: StepModel, record_dir: Path, pgw_url: str, steps: int):
    dead_url = f"http://127.0.0.1:{processes.free_port()}"
    with TrainingMonitor(job="bench", run="alive", pushgateway=pgw_url, push_interval=0.5,
                         record_path=record_dir / "alive.jsonl") as alive, \
            TrainingMonitor(job="bench", run="dead", pushgateway=dead_url, push_interval=0.5,
                            record_path=record_dir / "dead.jsonl") as dead:
        times = paired_steps(model, {"alive": alive, "dead": dead}, steps)
        failures = dead._pusher.failures
    ratio = median(times["dead"]) / median(times["alive"])
    return [("training step, Pushgateway alive", f"median {median(times['alive']) * 1e3:.2f} ms", ""),
            ("training step, Pushgateway dead", f"median {median(times['dead']) * 1e3:.2f} ms",
             f"dead/alive {ratio:.3f} ({failures} failed pushes; target equal within noise)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--baseline", default=BASELINE, metavar="REV",
                        help=f"the revision log() is compared with (default {BASELINE}; 'none': no comparison)")
    parser.add_argument("--log-only", action="store_true", help="only the comparison of log() with --baseline")
    parser.add_argument("--worker", metavar="TREE", help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=4000, help=argparse.SUPPRESS)
    args = parser.parse_args()
    scale = 0.2 if args.quick else 1.0
    torch.set_num_threads(1)  # steadier step times on a shared machine
    if args.worker:
        print(json.dumps(log_cases(args.calls)))
        return
    rows = [] if args.baseline == "none" else bench_against(args.baseline, 3 if args.quick else 7, int(4000 * scale))
    if args.log_only:
        print_rows(rows, f"torch {torch.__version__}, 1 CPU thread")
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        pgw = processes.pushgateway(workdir).start()
        try:
            model = StepModel()
            rows += bench_overhead(model, workdir, pgw.url, steps=int(600 * scale))
            rows += bench_grad_norm(int(600 * scale))
            rows += bench_dead_vs_alive(model, workdir, pgw.url, steps=int(400 * scale))
        finally:
            pgw.stop()
    print_rows(rows, f"torch {torch.__version__}, 1 CPU thread, step model width {model.width}")


def print_rows(rows: list[tuple[str, str, str]], heading: str) -> None:
    width = max(len(r[0]) for r in rows)
    print(heading)
    for name, first, second in rows:
        print(f"{name:<{width}}  {first:<18}  {second}")


if __name__ == "__main__":
    main()
