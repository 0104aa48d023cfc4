"""trainer_hook and the device: no CUDA initialisation, no sync on the training thread, GPU identity."""
from __future__ import annotations

import pytest
import torch

from tests.hook_support import SyncCounter, record_lines
from trainer_hook import TrainingMonitor, _torch


def monitor(tmp_path, **kwargs) -> TrainingMonitor:
    kwargs.setdefault("job", "device")
    kwargs.setdefault("run", "r1")
    kwargs.setdefault("pushgateway", False)
    kwargs.setdefault("record_path", tmp_path / "record.jsonl")
    return TrainingMonitor(**kwargs)


def test_cuda_ready_never_asks_the_driver_before_cuda_is_initialised(monkeypatch):
    """is_available() may initialise the driver (and poison fork for DataLoader workers)."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert _torch.cuda_ready() is False
    assert asked == []


def test_a_step_tensor_is_read_on_the_worker_not_the_training_thread(tmp_path):
    counter = SyncCounter()
    with monitor(tmp_path) as m:
        step = torch.tensor(5)
        with counter:
            m.log({"loss": torch.tensor(1.0)}, step=step)
            step += 1  # updated in place by the loop: the logged step stays 5
            m.log({"loss": 2.0})
            m.log({"loss": 3.0, "step": torch.tensor(9.0)})
            m.log({"loss": 4.0}, step=torch.tensor(float("nan")))  # counted as the next step
    assert counter.syncs == 0
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [x["step"] for x in steps] == [5, 6, 9, 10]


def test_a_steps_tensors_are_copied_once_per_dtype_and_keep_their_logged_values(tmp_path):
    """One on-device copy (a stack) per (device, dtype) per log(), not one per tensor; in-place
    updates after log() do not change what was logged; dtypes are not mixed into one copy."""
    losses = {f"loss{i}": torch.tensor(float(i), requires_grad=True) * 2 for i in range(30)}
    counter = SyncCounter()
    with monitor(tmp_path) as m:
        with counter:
            m.log(losses, step=0)
        assert counter.syncs == 0
        copies = [op for op in counter.ops if op.split(".")[0] in ("clone", "stack", "cat", "_to_copy", "copy_")]
        assert copies == ["stack.default"], counter.ops
        counter = SyncCounter()
        tokens = torch.tensor(123_456_789)  # not representable in float16
        with counter:
            m.log({"half": torch.tensor(0.5, dtype=torch.float16), "tokens_seen": tokens,
                   "vector": torch.ones(2)}, step=1)
        assert counter.syncs == 0
        tokens += 1  # in place, after log()
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert steps[0]["values"] == {f"loss{i}": 2.0 * i for i in range(30)}
    assert steps[1]["values"] == {"half": 0.5, "tokens_seen": 123_456_789.0}
