"""A small real PyTorch training run instrumented with trainer_hook, for the demo and the tests.

It trains an MLP on synthetic regression data and can stage the classic failures on purpose:
an input-bound phase (the data loader sleeps, so the GPU/CPU waits for data), a gradient
explosion (the learning rate is multiplied at one step, the norm spikes, then the loss goes NaN),
and a leak (each step's input batch is kept, a cache that never evicts; capped).

    python -m stack.demo_training --pushgateway http://127.0.0.1:9091 --steps 300 --explode-at 250
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import signal
import time
from collections.abc import Callable, Iterator

import torch

from trainer_hook import TrainingMonitor

BATCH_SIZE = 64
LEAK_CAP = 2000  # batches a leaking run keeps (bounded: at most 32 MB at batch size 128)


class SyntheticBatches:
    """Endless batches of y = x·w + noise; `delay` seconds of simulated I/O before each batch."""

    def __init__(self, features: int, batch_size: int = BATCH_SIZE, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.weights = torch.randn(features, 1, generator=self.generator)
        self.features = features
        self.batch_size = batch_size
        self.delay = 0.0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            if self.delay:
                time.sleep(self.delay)  # the simulated slow data loader of the input-bound phase
            x = torch.randn(self.batch_size, self.features, generator=self.generator)
            yield x, x @ self.weights + 0.1 * torch.randn(self.batch_size, 1, generator=self.generator)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stack.demo_training", description=__doc__.splitlines()[0])
    parser.add_argument("--pushgateway", help="Pushgateway URL (default: $DUALTRACK_PUSHGATEWAY)")
    parser.add_argument("--job", default="demo")
    parser.add_argument("--run", default="mlp-lr1e-2")
    parser.add_argument("--steps", type=int, default=0, help="steps to train; 0 trains until stopped")
    parser.add_argument("--step-time", type=float, default=0.05,
                        help="seconds of simulated compute per step (paces the run)")
    parser.add_argument("--push-interval", type=float, default=5.0)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--input-bound", metavar="FROM:TO", default="",
                        help="seconds since the start during which the data loader is slow (e.g. 60:120)")
    parser.add_argument("--data-delay", type=float, default=0.2,
                        help="seconds the slow data loader waits before each batch")
    parser.add_argument("--explode-at", type=int, default=-1,
                        help="step at which the learning rate jumps x1e4 (grad norm spike, then NaN); "
                             "the run then rolls back to its last checkpoint and carries on")
    parser.add_argument("--explode-after", type=float, default=-1.0, metavar="SECONDS",
                        help="the same explosion, at the first step this many seconds after the start")
    parser.add_argument("--bad-batch-after", type=float, default=-1.0, metavar="SECONDS",
                        help="one corrupt input batch (a NaN feature) at the first step this many seconds after "
                             "the start: a non-finite loss, then the run rolls back to its last checkpoint")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--data-workers", type=int, default=4,
                        help="recorded in the run's config (the demo's loader is synthetic)")
    parser.add_argument("--leak", action="store_true",
                        help=f"keep each step's input batch, a cache that never evicts (at most {LEAK_CAP} steps)")
    parser.add_argument("--gpu-uuid", default=None,
                        help="GPU UUID this run trains on, for simulated GPUs (on CUDA the hook finds it)")
    parser.add_argument("--record-path", default=None, help="local JSON-lines record")
    parser.add_argument("--grad-scaler", action="store_true",
                        help="train through a torch.amp.GradScaler (watched: loss scale, skipped overflow steps)")
    args = parser.parse_args(argv)
    first, _, last = args.input_bound.partition(":")
    args.input_bound = (float(first), float(last)) if args.input_bound else (0.0, 0.0)
    return args


def train(args: argparse.Namespace, stopped: Callable[[], bool] = lambda: False) -> None:
    """Run the training loop described by `args` (see parse_args) until done or `stopped()`."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a sweep runs several of these side by side on a few cores
    features = 32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)
    batches = SyntheticBatches(features, args.batch_size)
    config = {"learning_rate": args.learning_rate, "batch_size": args.batch_size,
              "data_workers": args.data_workers, "model": "mlp-32-64-1"}
    kept: list[torch.Tensor] = []  # the --leak bug
    with TrainingMonitor(job=args.job, run=args.run, pushgateway=args.pushgateway,
                         push_interval=args.push_interval, config=config,
                         gpu_uuid=args.gpu_uuid, record_path=args.record_path) as monitor:
        scaler = torch.amp.GradScaler(device.type) if args.grad_scaler else None
        if scaler is not None:
            monitor.watch(model, optimizer, scaler=scaler)
        step, exploded, corrupted = 0, False, False
        checkpoint = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        run_started = time.monotonic()
        for batch_id, (x, y) in enumerate(monitor.loader(batches)):
            started = time.monotonic()
            x, y = x.to(device), y.to(device)
            slow_from, slow_to = args.input_bound
            batches.delay = args.data_delay if slow_from <= started - run_started < slow_to else 0.0
            if not exploded and (step == args.explode_at or
                                 0 <= args.explode_after <= started - run_started):
                exploded = True
                for group in optimizer.param_groups:
                    group["lr"] *= 1e4
            if not corrupted and 0 <= args.bad_batch_after <= started - run_started:
                corrupted = True
                x = x.clone()
                x[0, 0] = math.nan  # a corrupt record in the input
            loss = torch.nn.functional.mse_loss(model(x), y)
            if args.leak and len(kept) < LEAK_CAP:
                kept.append(x)
            if scaler is None:
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                optimizer.step()
            else:  # an overflow (after the explosion) makes the scaler skip the step and halve its scale
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad(set_to_none=True)
            monitor.log({"loss": loss, "grad_norm": norm, "r2": 1 - loss.detach() / y.var(),
                         "learning_rate": optimizer.param_groups[0]["lr"], "epoch": step // 100},
                        step=step, samples=args.batch_size, tokens=x.numel(), batch_id=batch_id)
            if not math.isfinite(loss.item()):  # the demo's own NaN check, like a real trainer's
                model.load_state_dict(checkpoint[0])
                optimizer.load_state_dict(checkpoint[1])
            elif step % 100 == 0 and not exploded:
                checkpoint = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
            step += 1
            if (args.steps and step >= args.steps) or stopped():
                break
            remaining = args.step_time - (time.monotonic() - started)
            if remaining > 0:
                time.sleep(remaining)  # pacing: the demo model is far faster than a real one


def main(argv: list[str] | None = None) -> None:
    """Train; SIGTERM or SIGINT (the stack stopping its runs) ends the run as `finished` after the
    current step, then the process dies of that signal (no wait at exit: the janitor deletes the
    run's group)."""
    received: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, _frame: received.append(signum))
    train(parse_args(argv), stopped=lambda: bool(received))
    if received:
        signal.signal(received[0], signal.SIG_DFL)
        os.kill(os.getpid(), received[0])


if __name__ == "__main__":
    main()
