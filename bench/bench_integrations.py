"""Framework integrations' cost per training step on CPU, side by side in one run
(`.venv/bin/python bench/bench_integrations.py`).

For each framework, training blocks without the integration, with it, and without it again (the
noise floor) alternate, several rounds; the figures are the median step interval of each variant
(between the ends of consecutive steps, marked by a timing callback present in every variant), the
ratios with/without, and the time spent inside the integration's own per-step hooks as a share of
the plain step. Times are CPU time (`time.process_time`: every thread of this process, the hook's
background thread included; torch runs on one thread), which other processes' load on a shared
machine does not inflate the way it inflates wall time. Pushes go to a real Pushgateway.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from stack import processes

VARIANTS = ("plain", "dualtrack", "plain again")
WIDTH = 1536  # the MLP of the Lightning and Accelerate loops: ~20 ms CPU steps, like the GPT-2's


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class HookClock:
    """Seconds spent inside an integration's per-step hooks (start-up and close are one-off costs,
    left out)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0

    def timed(self, integration: object, hooks: tuple[str, ...]) -> object:
        """Wrap the integration's methods named `hooks` on this instance with a stopwatch."""
        for name in hooks:
            setattr(integration, name, self._stopwatch(getattr(integration, name)))
        return integration

    def _stopwatch(self, method: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - started
        return timed


def compare(block: Callable[[str, list[float], HookClock], None], rounds: int) -> dict[str, float]:
    """Run `block(variant, step_ends, clock)` for each variant, `rounds` times interleaved.

    Returns the median step interval per variant and "hook": hook seconds per step."""
    intervals: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    clock = HookClock()
    for _ in range(rounds):
        for variant in VARIANTS:
            ends: list[float] = []
            block(variant, ends, clock)
            intervals[variant] += [b - a for a, b in zip(ends[1:], ends[2:])]  # skip the first step
            if variant == "dualtrack":
                clock.steps += len(ends)
    return {**{variant: median(times) for variant, times in intervals.items()},
            "hook": clock.seconds / max(1, clock.steps)}


def huggingface(monitor_args: dict, steps: int, rounds: int) -> dict[str, float]:
    import transformers

    from trainer_hook.integrations.huggingface import DualtrackCallback

    class StepEnds(transformers.TrainerCallback):
        def __init__(self, ends: list[float]) -> None:
            self.ends = ends

        def on_step_end(self, *args, **kwargs) -> None:
            self.ends.append(time.process_time())

    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=512, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 512, (steps * 8, 64))]

    def block(variant: str, ends: list[float], clock: HookClock) -> None:
        callbacks = [StepEnds(ends)]
        if variant == "dualtrack":
            callbacks.append(clock.timed(DualtrackCallback(**monitor_args), (
                "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end",
                "on_substep_end", "on_log")))
        args = transformers.TrainingArguments(
            output_dir=monitor_args["record_path"] / "hf", max_steps=steps, per_device_train_batch_size=8,
            logging_steps=10_000, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)
        trainer.remove_callback(transformers.PrinterCallback)  # no per-run summary on stdout
        trainer.train()

    return compare(block, rounds)


def lightning(monitor_args: dict, steps: int, rounds: int) -> dict[str, float]:
    import lightning.pytorch as pl

    from trainer_hook.integrations.lightning import DualtrackCallback

    class StepEnds(pl.Callback):
        def __init__(self, ends: list[float]) -> None:
            self.ends = ends

        def on_train_batch_end(self, *args) -> None:
            self.ends.append(time.process_time())

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(256, WIDTH), torch.nn.ReLU(),
                                           torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                           torch.nn.Linear(WIDTH, 1))

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    module = MLP()
    data = torch.utils.data.TensorDataset(torch.randn(steps * 64, 256), torch.randn(steps * 64, 1))

    def block(variant: str, ends: list[float], clock: HookClock) -> None:
        callbacks = [StepEnds(ends)]
        if variant == "dualtrack":
            callbacks.append(clock.timed(DualtrackCallback(**monitor_args), (
                "on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")))
        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, gradient_clip_val=1.0, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=callbacks)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=64))

    return compare(block, rounds)


def accelerate_loop(monitor_args: dict, steps: int, rounds: int) -> dict[str, float]:
    import accelerate

    from trainer_hook.integrations.accelerate import DualtrackTracker

    torch.manual_seed(0)
    tracker = DualtrackTracker(**monitor_args)
    clocked: list[HookClock] = []  # the clock of the first block: the tracker is created once
    accelerator = accelerate.Accelerator(cpu=True, log_with=[tracker])
    model = torch.nn.Sequential(torch.nn.Linear(256, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(steps * 64, 256), torch.randn(steps * 64, 1)),
        batch_size=64)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    accelerator.init_trackers("bench", config={"lr": 1e-3})
    step = [0]

    def block(variant: str, ends: list[float], clock: HookClock) -> None:
        if not clocked:
            clocked.append(clock)
            tracker.log({"warm-up": 0.0}, step=-1)  # creates the monitor: a one-off cost
            clock.timed(tracker, ("log",))
        tracked = variant == "dualtrack"
        for inputs, targets in (tracker.loader(data) if tracked else data):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if tracked:
                accelerator.log({"loss": loss.detach(), "lr": 1e-3, "samples": 64}, step=step[0])
                step[0] += 1
            ends.append(time.process_time())

    try:
        return compare(block, rounds)
    finally:
        accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    args = parser.parse_args()
    steps, rounds = (20, 2) if args.quick else (60, 6)
    torch.set_num_threads(1)  # steadier step times on a shared machine
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        pgw = processes.pushgateway(workdir).start()
        try:
            monitor_args = {"job": "bench", "run": "integrations", "pushgateway": pgw.url,
                            "push_interval": 1.0, "record_path": workdir}
            print(f"{'framework':<13}{'plain':>10}{'dualtrack':>11}{'again':>10}"
                  f"{'overhead':>10}{'noise floor':>13}{'in hooks/step':>15}{'share':>8}")
            for name, bench in (("huggingface", huggingface), ("lightning", lightning),
                                ("accelerate", accelerate_loop)):
                result = bench(monitor_args, steps, rounds)
                plain, tracked, again = (result[variant] for variant in VARIANTS)
                print(f"{name:<13}{plain * 1e3:>8.2f}ms{tracked * 1e3:>9.2f}ms{again * 1e3:>8.2f}ms"
                      f"{(tracked / plain - 1) * 100:>+9.2f}%{(again / plain - 1) * 100:>+12.2f}%"
                      f"{result['hook'] * 1e6:>13.1f}us{result['hook'] / plain * 100:>7.2f}%",
                      flush=True)
        finally:
            pgw.stop()


if __name__ == "__main__":
    main()
