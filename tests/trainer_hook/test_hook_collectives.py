"""watch() and a DDP model: the collectives' timing, the opt-out, a user's communication hook, and
the training thread's phase and frame (trainer_hook/collectives.py), in this process (world size 1)."""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator

import pytest
import requests
import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from stack import processes
from tests.support.hook import SyncCounter, pull_monitor, pulled, wait_pulled
from trainer_hook import TrainingMonitor


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def group(request) -> Iterator[str]:
    """A one-rank process group in this process ("gloo", or the backend a test parametrizes)."""
    backend = getattr(request, "param", "gloo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def samples(monitor: TrainingMonitor, name: str) -> list[dict[str, str]]:
    """The labels of each sample named `name` the monitor serves whose value is 1."""
    text = requests.get(f"http://127.0.0.1:{monitor.listen_port}/metrics", timeout=5).text
    return [sample.labels for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name and sample.value == 1]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, monitor: TrainingMonitor, steps: int,
          device: str = "cpu") -> None:
    for step in range(steps):
        loss = model(torch.randn(8, 16, device=device)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.log({"loss": loss.detach()}, step=step)


def test_watch_times_a_ddp_models_all_reduces(tmp_path, group):
    """Each step's gradient all-reduce is counted and timed; the training thread reads no device value."""
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pull_monitor(tmp_path, "ddp") as monitor:
        monitor.watch(model, optimizer)
        counter = SyncCounter()
        with counter:
            train(model, optimizer, monitor, 5)
        assert counter.syncs == 0
        wait_pulled(monitor, "training_collectives_total", lambda v: v == 5)
        assert pulled(monitor, "training_collective_sequence") == 5
        assert pulled(monitor, "training_collective_wait_seconds_total") > 0
        wait_pulled(monitor, "training_compute_seconds_total", lambda v: v > 0)
        assert samples(monitor, "training_rank_phase") == [{"run": "r1", "rank": "0", "phase": "compute"}]
    # the all-reduce still averages: one rank's gradients are its own
    assert model._comm_hooks and model._comm_hooks[0][0].__qualname__ == "CollectiveTimer.hook"


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_collectives_timing_can_be_turned_off(tmp_path, group, monkeypatch, how):
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if how == "environment":
        monkeypatch.setenv("DUALTRACK_COLLECTIVES", "0")
    with pull_monitor(tmp_path, "ddp") as monitor:
        monitor.watch(model, optimizer, **({"collectives": False} if how == "argument" else {}))
        train(model, optimizer, monitor, 3)
        wait_pulled(monitor, "training_steps_total", lambda v: v == 3)
        assert pulled(monitor, "training_collective_wait_seconds_total") is None
        assert pulled(monitor, "training_collectives_total") is None
        assert samples(monitor, "training_rank_phase")  # the phase does not need the timing
    assert model._comm_hooks == []


def test_a_users_communication_hook_is_kept_and_watch_warns_once(tmp_path, group, caplog):
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="trainer_hook"), pull_monitor(tmp_path, "ddp") as monitor:
        monitor.watch(model, optimizer)
        monitor.watch(model, optimizer)
        train(model, optimizer, monitor, 3)
        wait_pulled(monitor, "training_steps_total", lambda v: v == 3)
        assert pulled(monitor, "training_collective_wait_seconds_total") is None
    assert [hook for hook, _ in model._comm_hooks] == [allreduce_hook]
    warnings = [r.getMessage() for r in caplog.records if "communication hook" in r.getMessage()]
    assert len(warnings) == 1 and "it is kept" in warnings[0], warnings


def blocked_batches(release: threading.Event) -> Iterator[int]:
    yield 0
    release.wait(30)  # a read that does not return
    yield 1


def stuck_in_compute(release: threading.Event) -> None:
    release.wait(30)


@pytest.mark.parametrize("where, phase, function", [("loader", "loader", "blocked_batches"),
                                                    ("compute", "compute", "stuck_in_compute")])
def test_a_stalled_training_thread_reports_its_phase_and_innermost_frame(tmp_path, where, phase, function):
    """The training thread (the one that made the monitor) stalls in its data loader or in its own
    code: the hook's thread reports the phase and the innermost frame of the project's code."""
    release, ready = threading.Event(), threading.Event()
    made: list[TrainingMonitor] = []

    def training() -> None:
        with pull_monitor(tmp_path, "stall") as monitor:
            made.append(monitor)
            ready.set()
            for step, _ in enumerate(monitor.loader(blocked_batches(release) if where == "loader" else [0, 1])):
                if where == "compute" and step == 1:
                    stuck_in_compute(release)
                monitor.log({"loss": 1.0}, step=step)

    thread = threading.Thread(target=training)
    thread.start()
    try:
        ready.wait(10)
        monitor = made[0]
        processes.wait_until(lambda: [frame["frame"] for frame in samples(monitor, "training_rank_frame_info")
                                      if frame["frame"].startswith(f"{function} (test_hook_collectives.py:")],
                             10, what=f"the frame in {function}")
        assert samples(monitor, "training_rank_phase") == [{"run": "r1", "rank": "0", "phase": phase}]
    finally:
        release.set()
        thread.join(10)


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["nccl"], indirect=True)
def test_on_nccl_the_wait_is_read_from_cuda_events_without_a_sync(tmp_path, group):
    """NCCL: the all-reduces are timed with CUDA events read on the hook's thread; the training
    thread makes no device read."""
    torch.cuda.set_device(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1).cuda(), device_ids=[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pull_monitor(tmp_path, "nccl") as monitor:
        monitor.watch(model, optimizer)
        counter = SyncCounter()
        with counter:
            train(model, optimizer, monitor, 5, device="cuda")
        assert counter.syncs == 0
        wait_pulled(monitor, "training_collectives_total", lambda v: v == 5)
        wait = wait_pulled(monitor, "training_collective_wait_seconds_total", lambda v: v > 0)
        assert wait < 5.0  # milliseconds of GPU time, converted once
