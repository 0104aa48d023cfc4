"""monitor.paused(reason): the pause series a rank serves while paused, the time counted by reason,
the record's pause lines, and replay rebuilding them."""
from __future__ import annotations

import time

import pytest

from tests.support.hook import pull_monitor, pulled, record_lines, wait_pulled
from tests.support.records import replayed_text


def test_a_paused_rank_serves_its_pause_and_counts_it_by_reason(tmp_path):
    monitor = pull_monitor(tmp_path, "pause")
    try:
        monitor.log({"loss": 1.0}, step=0)
        assert monitor._pause_reason is None
        before = time.time()
        with monitor.paused("checkpoint"):
            assert monitor._pause_reason == "checkpoint"
            started = wait_pulled(monitor, "training_pause_start_timestamp_seconds", lambda v: v > 0,
                                  reason="checkpoint")
            assert before <= started <= time.time()
            wait_pulled(monitor, "training_paused_seconds_total", lambda v: v >= 0.2, reason="checkpoint")
            with monitor.paused("evaluation"):  # inside a pause: the outer one goes on
                assert monitor._pause_reason == "checkpoint"
        assert monitor._pause_reason is None
        monitor.log({"loss": 0.5}, step=1)
        with pytest.raises(KeyError):  # the body's exception passes through, the pause ends with it
            with monitor.paused(""):
                time.sleep(0.05)
                raise KeyError("disk full")
        time.sleep(0.3)  # two publishes
        assert pulled(monitor, "training_pause_start_timestamp_seconds", reason="checkpoint") is None
        checkpoint = pulled(monitor, "training_paused_seconds_total", reason="checkpoint")
        assert checkpoint >= 0.2
        assert pulled(monitor, "training_paused_seconds_total", reason="unspecified") >= 0.05
        assert pulled(monitor, "training_paused_seconds_total", reason="evaluation") is None
    finally:
        monitor.close()
    steps, events = record_lines(tmp_path / "record.jsonl")
    assert [line["step"] for line in steps] == [0, 1]
    pauses = [line for line in events if line["event"] == "pause"]
    assert [(p["reason"], p["seconds"] >= 0.2) for p in pauses] == [("checkpoint", True), ("unspecified", False)]
    assert steps[0]["time"] < pauses[0]["time"] < steps[1]["time"] < pauses[1]["time"]
    assert pauses[0]["seconds"] == pytest.approx(checkpoint, abs=0.01)


def test_a_pause_under_way_at_close_ends_with_the_run_and_replay_rebuilds_the_pauses(tmp_path):
    monitor = pull_monitor(tmp_path, "pause")
    monitor.log({"loss": 1.0}, step=0)
    with monitor.paused("checkpoint"):
        time.sleep(0.1)
    monitor.log({"loss": 1.0}, step=1)
    pause = monitor.paused("evaluation")
    pause.__enter__()
    time.sleep(0.1)
    monitor.close()  # inside the pause
    pause.__exit__(None, None, None)  # after close: nothing more
    _, events = record_lines(tmp_path / "record.jsonl")
    assert [e["event"] for e in events] == ["start", "pause", "pause", "end"]
    assert [e["reason"] for e in events[1:3]] == ["checkpoint", "evaluation"]
    text = replayed_text(tmp_path / "record.jsonl")
    totals = [line for line in text.splitlines() if line.startswith("training_paused_seconds_total{")]
    assert [line.split("reason=")[1].split('"')[1] for line in totals] == ["checkpoint"] * 2 + ["evaluation"] * 2
    last = float(totals[1].split()[-2])
    assert last == pytest.approx(events[1]["seconds"])
    assert float(totals[0].split()[-2]) == 0
    starts = [line for line in text.splitlines() if line.startswith("training_pause_start_timestamp_seconds{")]
    assert len(starts) == 4 and float(starts[0].split()[-2]) == pytest.approx(events[1]["time"])


def test_any_reason_becomes_a_bounded_printable_label_and_never_raises(tmp_path):
    monitor = pull_monitor(tmp_path, "pause", strict=True)
    try:
        class Unprintable:
            def __str__(self) -> str:
                raise RuntimeError("no text")

        for reason in (None, 42, "a\nb", "x" * 1000, "checkpoint", Unprintable()):
            with monitor.paused(reason):
                pass
    finally:
        monitor.close()
    _, events = record_lines(tmp_path / "record.jsonl")
    reasons = {e["reason"] for e in events if e["event"] == "pause"}
    assert {"None", "42", "a b", "x" * 256, "checkpoint", "unspecified"} == reasons
