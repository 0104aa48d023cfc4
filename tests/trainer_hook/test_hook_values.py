"""What the hook makes of logged values: exact-mean counters, non-finite streaks, window maxima
and their steps, data wait, and snapshots that never change once published."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from stack.processes import free_port
from tests.support.hook import pull_monitor, pulled, record_lines, wait_pulled
from trainer_hook import TrainingMonitor
from trainer_hook.contract import Snapshot
from trainer_hook.push import Pusher, make_handler

NAN = float("nan")


def monitor(tmp_path, **kwargs) -> TrainingMonitor:
    return pull_monitor(tmp_path, kwargs.pop("job", "values"), **kwargs)


def test_sum_and_count_per_key_hold_finite_values_only(tmp_path):
    losses = [2.0, NAN, 1.0, float("inf"), 0.5]
    with monitor(tmp_path) as m:
        for step, loss in enumerate(losses):
            m.log({"train/loss": torch.tensor(loss), "lr": 0.1}, step=step)
        wait_pulled(m, "training_steps_total", lambda v: v == 5)
        assert pulled(m, "training_logged_value_sum", key="loss") == 3.5
        assert pulled(m, "training_logged_value_count", key="loss") == 3
        assert pulled(m, "training_nonfinite_values_total", key="loss") == 2
        assert pulled(m, "training_logged_value_count", key="learning_rate") == 5
        assert pulled(m, "training_nonfinite_values_total", key="learning_rate") == 0


def test_first_nonfinite_step_is_the_start_of_the_current_streak(tmp_path):
    with monitor(tmp_path) as m:
        for step, loss in enumerate([1.0, 1.0, 1.0, NAN, NAN, NAN]):
            m.log({"loss": loss}, step=step, batch_id=100 + step)
        wait_pulled(m, "training_last_nonfinite_step", lambda v: v == 5)
        assert pulled(m, "training_first_nonfinite_step") == 3
        assert pulled(m, "training_first_nonfinite_batch_id") == 103
        for step, loss in enumerate([1.0, NAN, NAN], start=6):  # recovered, then a new streak
            m.log({"loss": loss}, step=step, batch_id=100 + step)
        wait_pulled(m, "training_last_nonfinite_step", lambda v: v == 8)
        assert pulled(m, "training_first_nonfinite_step") == 7
        assert pulled(m, "training_nonfinite_steps_total") == 5


def test_window_maximum_comes_with_the_step_it_was_seen_at(tmp_path):
    with monitor(tmp_path, max_hold=30.0) as m:
        assert pulled(m, "training_grad_norm_max_step") is None
        for step, norm in enumerate([1.0, 3.0, 250.0, 2.0, 250.0]):
            m.log({"grad_norm": norm, "loss": 10.0 - step}, step=40 + step)
        wait_pulled(m, "training_grad_norm_max", lambda v: v == 250.0)
        assert pulled(m, "training_grad_norm_max_step") == 42  # the first step with that value
        assert pulled(m, "training_loss_max_step") == 40


def test_data_wait_argument_adds_to_the_counter_and_the_record(tmp_path):
    def batches():
        yield from range(3)

    with monitor(tmp_path) as m:
        m.log({"loss": 1.0}, data_wait=0.25)
        for _ in m.loader(batches()):
            m.log({"loss": 1.0}, data_wait=0.5)
        m.log({"loss": 1.0}, data_wait=-1.0)  # dropped, counted
        m.log({"loss": 1.0}, data_wait=NAN)
        wait_pulled(m, "training_steps_total", lambda v: v == 6)
        total = pulled(m, "training_data_wait_seconds_total")
        assert 1.75 <= total < 1.85
        assert pulled(m, "training_dropped_values_total", reason="out_of_range") == 2
    steps, _ = record_lines(tmp_path / "record.jsonl")
    waits = [x["data_wait_seconds"] for x in steps]
    assert waits[0] == 0.25 and all(0.5 <= w < 0.55 for w in waits[1:4]) and waits[4:] == [0.0, 0.0]
    assert sum(waits) == pytest.approx(total)


def test_a_snapshot_is_never_changed_after_it_was_published(tmp_path):
    """Pull mode may be serving the snapshot that a failed push carries its maxima into."""
    with TrainingMonitor(job="j", run="r", pushgateway=f"http://127.0.0.1:{free_port()}",
                         push_timeout=0.5, record_path=False, max_hold=0.0) as m:
        settings = m.settings
    pusher = Pusher(settings, make_handler(settings))
    try:
        assert not pusher.push(Snapshot(maxima={"grad_norm": 9.0}, max_steps={"grad_norm": 3}))
        served = Snapshot(maxima={"grad_norm": 1.0}, max_steps={"grad_norm": 4})
        before = dataclasses.asdict(served)
        assert not pusher.push(served)  # carries the first one's maximum
        assert dataclasses.asdict(served) == before
    finally:
        pusher.stop(1.0)
