"""Hook side of the fault suite: Pushgateway faults, crashes, SIGTERM and hostile values never hurt training.

Outages here last a few seconds (5 s for the killed Pushgateway), not a minute, to keep the suite
fast: what matters is that many pushes fail in a row, and push_interval is 0.2-0.3 s.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
import torch

from stack import processes
from tests.support.hook import Trainer, http_gateway, pushed_value, record_lines, run_id, wait_pushed
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.fault


@contextlib.contextmanager
def bad_gateway(mode: str):
    """A Pushgateway stand-in that answers every push with 500, or only after 10 s ("slow")."""
    release = threading.Event()

    def respond(request) -> int:
        if mode == "slow":
            release.wait(10)  # answers after 10 s (released at teardown)
            return 200
        return 500

    try:
        with http_gateway(respond) as url:
            yield url
    finally:
        release.set()


@pytest.fixture
def pgw(tmp_path, start_service):
    return start_service(processes.pushgateway(tmp_path))


def _train_both(healthy: TrainingMonitor, faulty: TrainingMonitor, steps: int = 240) -> None:
    """Two real training loops, alternating step by step, one logging to each monitor."""
    trainers = {"healthy": Trainer(), "faulty": Trainer()}
    for _ in range(steps):
        for name, mon in (("healthy", healthy), ("faulty", faulty)):
            trainers[name].train_step(mon)


@pytest.mark.parametrize("fault", ["http_500", "slow_10s", "wrong_address"])
def test_pushgateway_fault_leaves_training_and_its_record_intact(pgw, tmp_path, fault, caplog):
    faulty_url = None
    with contextlib.ExitStack() as stack:
        if fault == "wrong_address":
            faulty_url = f"http://127.0.0.1:{processes.free_port()}"
        else:
            faulty_url = stack.enter_context(bad_gateway("500" if fault == "http_500" else "slow"))
        caplog.set_level(logging.WARNING, logger="trainer_hook")
        healthy = TrainingMonitor(job="faults", run=run_id("healthy"), pushgateway=pgw.url,
                                  push_interval=0.2, record_path=tmp_path / "healthy.jsonl")
        faulty = TrainingMonitor(job="faults", run=run_id(fault), pushgateway=faulty_url,
                                 push_interval=0.2, record_path=tmp_path / "faulty.jsonl")
        _train_both(healthy, faulty)
        healthy.close()
        started = time.monotonic()
        faulty.close()
        close_seconds = time.monotonic() - started
    steps, events = record_lines(tmp_path / "faulty.jsonl")
    assert [x["step"] for x in steps] == list(range(240)) and events[-1]["state"] == "finished"
    assert close_seconds < 2 * faulty.settings.push_timeout + 2  # the final push gives up in time
    warnings = [r.getMessage() for r in caplog.records if "training continues" in r.getMessage()]
    assert len(warnings) == 1 and faulty_url in warnings[0]  # one warning for the whole outage
    assert faulty._pusher.failures >= 2


def test_memory_stays_bounded_while_pushes_fail(tmp_path):
    """Thousands of steps over ~15 failed pushes: what the hook holds does not grow."""
    url = f"http://127.0.0.1:{processes.free_port()}"
    with TrainingMonitor(job="faults", run=run_id("memory"), pushgateway=url, push_interval=0.1,
                         push_timeout=0.5, record_path=tmp_path / "r.jsonl") as monitor:
        tracemalloc.start()
        try:
            def held() -> int:
                monitor._drain()
                gc.collect()  # a full collection also empties CPython's free lists of freed tuples
                snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*trainer_hook*")])
                return sum(stat.size for stat in snap.statistics("filename"))

            step, pace = 0, threading.Event()
            for phase in ("warm-up", "outage"):
                deadline = time.monotonic() + (0.5 if phase == "warm-up" else 2.0)
                while time.monotonic() < deadline:
                    monitor.log({"loss": float(step), "grad_norm": torch.tensor(1.0)}, step=step)
                    step += 1
                    if step % 20 == 0:
                        pace.wait(0.001)  # a real step releases the GIL in torch ops
                if phase == "warm-up":
                    before, failures_before = held(), monitor._pusher.failures
            after = held()
        finally:
            tracemalloc.stop()
        assert monitor._pusher.failures - failures_before >= 3
    assert after - before < 64 * 1024, (before, after)
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert len(steps) == step  # nothing lost


def test_pushgateway_killed_for_seconds_then_back(pgw, tmp_path):
    """5 s outage (push_interval 0.3 s: ~15 failed pushes); recovery refills the empty Pushgateway."""
    run = run_id("outage")
    trainer = Trainer()
    pace = threading.Event()
    with TrainingMonitor(job="faults", run=run, pushgateway=pgw.url, push_interval=0.3,
                         push_timeout=1.0, record_path=tmp_path / "r.jsonl") as monitor:
        for _ in range(20):
            trainer.train_step(monitor)
        wait_pushed(pgw.url, "training_steps_total", run, lambda v: v == 20)
        pgw.kill()
        outage_end = time.monotonic() + 5
        while time.monotonic() < outage_end:
            trainer.train_step(monitor)
            pace.wait(0.01)
        pgw.start()
        for _ in range(20):
            trainer.train_step(monitor)
        total = trainer.step
        wait_pushed(pgw.url, "training_steps_total", run, lambda v: v == total)
        assert pushed_value(pgw.url, "training_push_failures_total", run) >= 5
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert [x["step"] for x in steps] == list(range(total))
    assert pushed_value(pgw.url, "training_run_state", run, state="finished") == 1


@pytest.mark.parametrize("error", [RuntimeError("loss went sideways"),
                                   torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")],
                         ids=["RuntimeError", "OutOfMemoryError"])
def test_exception_in_the_loop_pushes_failed_state_and_flushes_record(pgw, tmp_path, error):
    run = run_id("crash")
    trainer = Trainer()
    with pytest.raises(type(error)):
        with TrainingMonitor(job="faults", run=run, pushgateway=pgw.url, push_interval=60,
                             record_path=tmp_path / "r.jsonl") as monitor:
            for step in range(30):
                trainer.train_step(monitor)
                if step == 29:
                    raise error
    # push_interval 60 s: only the final push can have delivered these.
    assert pushed_value(pgw.url, "training_steps_total", run) == 30
    assert pushed_value(pgw.url, "training_run_state", run, state="failed") == 1
    assert pushed_value(pgw.url, "training_run_state", run, state="running") == 0
    steps, events = record_lines(tmp_path / "r.jsonl")
    assert len(steps) == 30
    assert events[-1]["state"] == "failed" and events[-1]["reason"] == type(error).__name__
    assert events[-1]["message"] == str(error)


TRAINING_SCRIPT = """
import sys, time
from tests.support.hook import Trainer
from trainer_hook import TrainingMonitor
mode, url, record, run = sys.argv[1:5]
trainer = Trainer()
monitor = TrainingMonitor(job="faults", run=run, pushgateway=url, push_interval=60, record_path=record,
                          delete_after=None)  # keep the final state to check it
for step in range(100000):
    trainer.train_step(monitor)
    if step == 25:
        print("ready", flush=True)
        if mode == "exception":
            raise RuntimeError("boom")
        if mode == "exit":
            break
    if step > 25:
        time.sleep(0.01)
"""


@pytest.mark.parametrize("mode, state", [("sigterm", "failed"), ("exception", "failed"), ("exit", "finished")])
def test_process_end_without_close_still_pushes_and_flushes(pgw, tmp_path, mode, state):
    """A real subprocess that never calls close(): SIGTERM, an unhandled exception, or a plain exit."""
    run = run_id(mode)
    record = tmp_path / "r.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", TRAINING_SCRIPT, mode, pgw.url, str(record), run],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        if mode == "sigterm":
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        proc.kill()
    expected_rc = {"sigterm": -signal.SIGTERM, "exception": 1, "exit": 0}[mode]
    assert proc.returncode == expected_rc, proc.stderr.read()
    steps, events = record_lines(record)
    assert events[-1]["event"] == "end" and events[-1]["state"] == state
    assert pushed_value(pgw.url, "training_steps_total", run) == len(steps) >= 26
    assert pushed_value(pgw.url, "training_run_state", run, state=state) == 1
    if mode == "sigterm":
        assert events[-1]["reason"] == "SIGTERM"
    if mode == "exception":
        assert (events[-1]["reason"], events[-1]["message"]) == ("RuntimeError", "boom")


class Opaque:
    pass


HOSTILE = {
    "nan": float("nan"), "inf": float("inf"), "neg_inf": float("-inf"), "huge": 1e308,
    "negative": -5.0, "bool": True, "int": 7, "grad_tensor": torch.tensor(2.5, requires_grad=True) * 1,
    "int_tensor": torch.tensor(3), "half_tensor": torch.tensor(0.5, dtype=torch.float16),
    "nan_tensor": torch.tensor(float("nan")),
    # dropped, by reason
    "string": "0.5", "none": None, "object": Opaque(), "bytes": b"1",  # not_numeric
    "too_big": 10 ** 400,  # out_of_range
    "vector": torch.ones(3),  # not_scalar
    "meta_tensor": torch.empty((), device="meta"), "complex": torch.tensor(1 + 2j),  # unreadable
    "损失": 1.0, "///": 1.0,  # invalid_key (nothing left after sanitizing)
    "steps_total": 1.0,  # reserved_name
}
KEPT = {"nan": "nan", "inf": "inf", "neg_inf": "-inf", "huge": 1e308, "negative": -5.0, "bool": 1.0,
        "int": 7.0, "grad_tensor": 2.5, "int_tensor": 3.0, "half_tensor": 0.5, "nan_tensor": "nan"}
DROPPED = {"not_numeric": 4, "out_of_range": 1, "not_scalar": 1, "unreadable": 2, "invalid_key": 2,
           "reserved_name": 1}


def test_hostile_values_keys_and_labels_never_crash(pgw, tmp_path, caplog):
    run = run_id("values")
    config = {"quote": 'a "quoted" value', "newline": "line1\nline2", "unicode": "学习率 ✓",
              "nested": {"list": [1, 2]}, "bad name\n\"x\"": 1, "job": "shadow"}
    caplog.set_level(logging.WARNING, logger="trainer_hook")
    with TrainingMonitor(job="faults", run=run, pushgateway=pgw.url, push_interval=0.2, config=config,
                         record_path=tmp_path / "r.jsonl") as monitor:
        for step in range(3):
            monitor.log(HOSTILE, step=step, samples="many", batch_id=("shard", step), tokens=float("nan"))
        monitor.log([("loss", 1.0)], step=3)  # not a mapping: the step is still counted, the values not
        wait_pushed(pgw.url, "training_steps_total", run, lambda v: v == 4)
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert steps[0]["values"] == KEPT
    assert steps[0]["batch_id"] == ["shard", 0] and steps[0]["samples"] is None
    assert steps[0]["tokens"] == "nan"
    expected = {reason: 3 * count for reason, count in DROPPED.items()}
    expected["not_numeric"] += 3 + 1  # samples="many" three times, the list once
    for reason, count in expected.items():
        assert pushed_value(pgw.url, "training_dropped_values_total", run, reason=reason) == count, reason
    assert pushed_value(pgw.url, "training_nonfinite_steps_total", run) == 3
    assert pushed_value(pgw.url, "training_push_failures_total", run) == 0
    assert pushed_value(pgw.url, "training_huge", run) == 1e308
    assert math.isnan(pushed_value(pgw.url, "training_nan", run))
    info = pushed_value(pgw.url, "training_run_info", run, quote='a "quoted" value', newline="line1 line2",
                        unicode="学习率 ✓", nested_list="[1, 2]", bad_name_x="1", config_job="shadow")
    assert info == 1
    dropped_warnings = [r for r in caplog.records if "not kept" in r.getMessage()]
    assert len(dropped_warnings) == len(HOSTILE) - len(KEPT) + 2  # once per key (+ samples=, the list)
    assert steps[3]["values"] == {} and steps[3]["step"] == 3


@pytest.mark.parametrize("key, value", [(k, v) for k, v in HOSTILE.items() if k not in KEPT])
def test_strict_mode_raises_on_each_bad_value(tmp_path, key, value):
    with TrainingMonitor(job="faults", run="strict", pushgateway=False, strict=True,
                         record_path=tmp_path / "r.jsonl") as monitor:
        monitor.log({"loss": 1.0}, step=0)
        with pytest.raises(ValueError, match="was not kept"):
            monitor.log({key: value}, step=1)


@pytest.mark.parametrize("step", [torch.tensor(1 + 2j), torch.empty((), device="meta"), "seven"],
                         ids=["complex", "meta", "string"])
def test_hostile_step_never_raises_and_is_counted(tmp_path, step, caplog):
    caplog.set_level(logging.WARNING, logger="trainer_hook")
    with TrainingMonitor(job="faults", run="step", pushgateway=False, record_path=tmp_path / "r.jsonl") as monitor:
        monitor.log({"loss": 1.0}, step=step)  # counted as the next step (0), its values kept
        monitor.log({"loss": 2.0}, step=torch.tensor(5))
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert [(x["step"], x["values"]) for x in steps] == [(0, {"loss": 1.0}), (5, {"loss": 2.0})]
    assert len([r for r in caplog.records if "not kept" in r.getMessage()]) == 1
    with TrainingMonitor(job="faults", run="step", pushgateway=False, strict=True,
                         record_path=tmp_path / "s.jsonl") as strict:
        with pytest.raises(ValueError):
            strict.log({"loss": 1.0}, step=step)


def test_sigterm_in_a_forked_child_does_not_close_the_parents_run(pgw, tmp_path):
    """DataLoader workers are forks: their SIGTERM or exit must not push `failed` for the trainer."""
    run = run_id("fork")
    with TrainingMonitor(job="faults", run=run, pushgateway=pgw.url, push_interval=0.2,
                         record_path=tmp_path / "r.jsonl") as monitor:
        monitor.log({"loss": 1.0}, step=0)
        wait_pushed(pgw.url, "training_steps_total", run, lambda v: v == 1)
        pid = os.fork()
        if pid == 0:  # the child: die of SIGTERM with the inherited handler
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(3)  # not reached if SIGTERM killed us
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        monitor.log({"loss": 2.0}, step=1)
        wait_pushed(pgw.url, "training_steps_total", run, lambda v: v == 2)
        assert pushed_value(pgw.url, "training_run_state", run, state="running") == 1
    assert pushed_value(pgw.url, "training_run_state", run, state="finished") == 1
    _, events = record_lines(tmp_path / "r.jsonl")
    assert [e["event"] for e in events] == ["start", "end"]
