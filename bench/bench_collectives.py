"""Cost of timing DDP's all-reduces (`.venv/bin/python bench/bench_collectives.py`).

One gloo rank in this process, a DistributedDataParallel model under watch(): the median time of a
training step (forward, backward with its all-reduces, optimizer step, log()) with the collectives
timed (watch()'s communication hook) and without (`collectives=False`), interleaved in rounds so that
the machine's noise hits both alike. Prints one JSON object; `ratio` is timed / untimed.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer_hook import TrainingMonitor


def steps(timed: bool, count: int, width: int, workdir: Path) -> list[float]:
    """Seconds per training step of `count` steps of a fresh model, its collectives `timed` or not."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))),
                                    bucket_cap_mb=1)  # several buckets: several all-reduces a step
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, width)
    took = []
    with TrainingMonitor(job="bench", run=f"bench-{timed}", pushgateway=False, record_path=workdir / f"{timed}.jsonl",
                         push_interval=1.0) as monitor:
        monitor.watch(model, optimizer, collectives=timed)
        for step in range(count):
            start = time.perf_counter()
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.log({"loss": loss.detach()}, step=step)
            took.append(time.perf_counter() - start)
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    timed: list[float] = []
    untimed: list[float] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-collectives-") as tmp:
            for _ in range(args.rounds):
                untimed += steps(False, args.steps, args.width, Path(tmp))[10:]
                timed += steps(True, args.steps, args.width, Path(tmp))[10:]
    finally:
        dist.destroy_process_group()
    print(json.dumps({"steps": len(timed), "median_step_untimed_s": statistics.median(untimed),
                      "median_step_timed_s": statistics.median(timed),
                      "ratio": statistics.median(timed) / statistics.median(untimed)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
