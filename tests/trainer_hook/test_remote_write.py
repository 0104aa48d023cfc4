"""The hook's remote write (DUALTRACK_REMOTE_WRITE_URL) against a loopback receiver: Remote-Write 1.0's
encoding and headers, retries of 5xx/429, one warning for a refusing 4xx, the bounded queue, a hung
receiver that never holds up training, stale markers after the final state, and credentials."""
from __future__ import annotations

import email.utils
import logging
import math
import os
import struct
import threading
import time

import pytest

from stack import processes
from tests.support.hook import record_lines
from tests.support.remote_write import receiver
from trainer_hook import TrainingMonitor, push, remote_write
from trainer_hook.remote_write import STALE_NAN


def monitor(url: str, tmp_path, **kwargs) -> TrainingMonitor:
    options = {"job": "rw", "run": "r1", "instance": "host-a", "record_path": tmp_path / "rec.jsonl",
               "push_interval": 0.05, "push_timeout": 2.0, **kwargs}
    return TrainingMonitor(remote_write_url=url, **options)


def names(request) -> set[str]:
    return {dict(labels)["__name__"] for labels in request.series}


def is_stale(value: float) -> bool:
    return struct.pack("<d", value) == struct.pack("<d", STALE_NAN)


def test_requests_follow_remote_write_1_0(tmp_path):
    with receiver() as (url, got):
        mon = monitor(url, tmp_path, config={"Zeta": "", "lr": 0.1}, delete_after=0.5)
        for step in range(20):
            mon.log({"loss": 1.0 / (step + 1)}, step=step)
        mon.log({"loss": float("nan")}, step=20)
        mon.close()
        processes.wait_until(lambda: all(is_stale(samples[-1][1]) for samples in got[-1].series.values()),
                             30, what="the stale markers delete_after (0.5 s) after the final state")
    assert got, "nothing was written"
    for request in got:
        headers = {k.lower(): v for k, v in request.headers.items()}
        assert headers["content-encoding"] == "snappy"
        assert headers["content-type"] == "application/x-protobuf"
        assert headers["x-prometheus-remote-write-version"] == "0.1.0"
        assert headers["user-agent"].startswith("dualtrack-trainer-hook/")
        for labels in request.raw_labels:
            label_names = [name for name, _ in labels]
            assert label_names == sorted(label_names) and len(set(label_names)) == len(label_names)
            assert "__name__" in label_names and all(value != "" for _, value in labels)
            assert {"job": "rw", "run": "r1", "rank": "0", "instance": "host-a"}.items() <= dict(labels).items()
        for samples in request.series.values():
            stamps = [ms for ms, _ in samples]
            assert stamps == sorted(set(stamps))
    series = {}
    for request in got:
        for labels, samples in request.series.items():
            series.setdefault(labels, []).extend(samples)
    by_name = {}
    for labels, samples in series.items():
        by_name.setdefault(dict(labels)["__name__"], []).append((dict(labels), samples))
    # the same names as the Pushgateway path, plus the hook's own push time; le as Prometheus stores it
    assert {"training_step", "training_loss", "training_nonfinite_steps_total", "training_run_state",
            "training_step_duration_seconds_bucket", "training_last_push_timestamp_seconds"} <= set(by_name)
    assert {labels["le"] for labels, _ in by_name["training_step_duration_seconds_bucket"]} >= {"1", "0.001", "+Inf"}
    run_info = by_name["training_run_info"][0][0]
    assert run_info["lr"] == "0.1" and "Zeta" not in run_info  # an empty value is no label
    (_, loss), = by_name["training_loss"]
    finite = [value for _, value in loss if not is_stale(value)]
    assert math.isnan(finite[-1]) and not is_stale(finite[-1])  # a real NaN, not the stale marker
    # each sample at the hook's publish time, which training_last_push_timestamp_seconds carries
    (_, pushed), = by_name["training_last_push_timestamp_seconds"]
    assert all(ms == round(value * 1000) for ms, value in pushed if not is_stale(value))
    states = {labels["state"]: samples for labels, samples in by_name["training_run_state"]}
    final_ms, final = [(ms, v) for ms, v in states["finished"] if not is_stale(v)][-1]
    assert final == 1.0
    # then, delete_after later, one request of stale markers for every series of the final state
    final_series = {labels for labels, samples in series.items() if any(ms == final_ms for ms, _ in samples)}
    assert set(got[-1].series) == final_series
    assert {(is_stale(v), ms >= final_ms + 500) for samples in got[-1].series.values() for ms, v in samples} \
        == {(True, True)}


def test_a_refusing_receiver_is_warned_about_once_and_counted(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainer_hook")
    # The receiver's answer is shown, its control characters escaped (a terminal escape, a C1 CSI).
    with receiver(lambda _: (400, "out of order sample \x1b[2J\x9b31m\nsecond line".encode())) as (url, got):
        mon = monitor(url, tmp_path)
        for step in range(5):
            mon.log({"loss": 1.0}, step=step)
        processes.wait_until(lambda: len(got) >= 3, 30, what="three refused requests")
        mon.close()
        refused = len(got)
    refusals = [r for r in caplog.records if "refused the samples" in r.getMessage()]
    assert len(refusals) == 1 and "HTTP 400: out of order sample \\x1b[2J\\x9b31m" in refusals[0].getMessage()
    assert not any(c in refusals[0].getMessage() for c in "\x1b\x9b\n")
    assert mon._writer.failures == refused  # every request was tried once: 4xx is not retried
    assert mon._latest.push_failures >= 1  # published in training_push_failures_total


@pytest.mark.parametrize("status", [503, 429])
def test_5xx_and_429_are_retried_until_accepted(tmp_path, monkeypatch, status):
    monkeypatch.setattr(remote_write, "FIRST_BACKOFF", 0.01)
    answers = iter([status, status])
    with receiver(lambda _: next(answers, 204)) as (url, got):
        mon = monitor(url, tmp_path, push_interval=60)  # one batch before close: the first request
        processes.wait_until(lambda: len(got) >= 3, 30, what="the retried request accepted")
        mon.close()
    assert got[0].series == got[1].series == got[2].series  # the same samples, tried again
    assert mon._writer.failures == 0


@pytest.mark.parametrize("retry_after", ["2", "http-date"])
def test_a_429_or_503_with_retry_after_is_retried_no_sooner(tmp_path, retry_after):
    """The receiver's Retry-After (seconds, or an HTTP date) is the wait before the next try, not the
    hook's own (much shorter) first backoff."""
    times: list[float] = []

    def respond(_):
        times.append(time.monotonic())
        if len(times) > 1:
            return 204
        when = "2" if retry_after == "2" else email.utils.formatdate(time.time() + 3, usegmt=True)
        return 429, b"slow down", {"Retry-After": when}

    with receiver(respond) as (url, got):
        mon = monitor(url, tmp_path, push_interval=60)
        processes.wait_until(lambda: len(got) >= 2, 30, what="the request retried after Retry-After")
        mon.close()
    assert times[1] - times[0] >= 1.5  # an HTTP date has whole seconds: 3 s ahead is at least 2 s
    assert mon._writer.failures == 0


def test_backoff_has_full_jitter(tmp_path, monkeypatch):
    """Without Retry-After each wait is drawn between 0 and the backoff: ranks that failed together do
    not retry together."""
    waits: list[float] = []
    monkeypatch.setattr(remote_write.random, "uniform", lambda low, high: waits.append(high) or low)
    with receiver(lambda _: 503) as (url, got):
        mon = monitor(url, tmp_path, push_interval=60)
        processes.wait_until(lambda: mon._writer.failures >= 1, 30, what="the request given up")
        assert len(got) == remote_write.MAX_ATTEMPTS
        mon.close()
    assert waits[:4] == [remote_write.FIRST_BACKOFF * 2 ** i for i in range(4)]


def test_retry_after_is_read_as_seconds_or_an_http_date_and_capped():
    now = 1_700_000_000.0
    read = remote_write.retry_after_seconds
    assert read("7", now) == 7.0 and read(None, now) is None and read("soon", now) is None
    assert read(email.utils.formatdate(now + 42, usegmt=True), now) == 42.0
    assert read(email.utils.formatdate(now - 5, usegmt=True), now) == 0.0
    assert read("999999", now) == remote_write.MAX_RETRY_AFTER


def test_retries_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(remote_write, "FIRST_BACKOFF", 0.01)
    with receiver(lambda _: 500) as (url, got):
        mon = monitor(url, tmp_path, push_interval=60)
        processes.wait_until(lambda: mon._writer.failures >= 1, 30, what="the request given up")
        assert len(got) == remote_write.MAX_ATTEMPTS
        mon.close()


def test_a_hung_receiver_bounds_the_queue_and_never_holds_up_training(tmp_path, monkeypatch):
    """The receiver never answers: the step loop still completes, every step reaches the local record,
    the queue stays within its bound (the oldest batches dropped and counted), close() returns."""
    monkeypatch.setattr(remote_write, "MAX_QUEUED_BATCHES", 5)
    release = threading.Event()
    with receiver(lambda _: 204 if release.wait(60) else 503) as (url, got):
        mon = monitor(url, tmp_path, push_interval=0.01, push_timeout=1.0)
        for step in range(5000):  # completes while the receiver hangs
            mon.log({"loss": 1.0}, step=step)
            assert len(mon._writer._queue) <= 5
        # the worker keeps publishing every 10 ms: the queue overflows, the oldest batches dropped
        processes.wait_until(lambda: mon._writer.failures >= 3, 60, what="batches dropped from a full queue")
        assert len(mon._writer._queue) <= 5
        mon.close()  # returns: waits at most push_timeout + 1 s for the hung receiver
        release.set()
    steps, _ = record_lines(tmp_path / "rec.jsonl")
    assert len(steps) == 5000  # the local record is kept as before


def test_credentials_from_the_environment_and_a_token_file(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("tok-42\n")
    os.chmod(token, 0o600)
    monkeypatch.setenv("DUALTRACK_REMOTE_WRITE_TOKEN_FILE", str(token))
    with receiver() as (url, got):
        monkeypatch.setenv("DUALTRACK_REMOTE_WRITE_URL", url)
        mon = TrainingMonitor(job="rw", run="env", record_path=False, push_interval=60)
        assert "tok-42" not in repr(mon.settings)
        mon.close()
    assert got and {r.headers["Authorization"] for r in got} == {"Bearer tok-42"}


def test_basic_auth_never_reaches_the_log(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="trainer_hook")
    with receiver(lambda _: 401) as (url, got):
        mon = monitor(url, tmp_path, remote_write_basic_auth=("user", "s3cret-pw"))
        mon.close()
    assert got and got[0].headers["Authorization"].startswith("Basic ")
    assert "s3cret-pw" not in caplog.text and "s3cret-pw" not in repr(mon.settings)
    with pytest.raises(ValueError, match="must not contain credentials") as error:
        monitor("http://user:s3cret-pw@127.0.0.1:1/api/v1/write", tmp_path)
    assert "s3cret-pw" not in str(error.value)


def test_unusable_tls_files_fail_the_constructor_and_leave_nothing_behind(tmp_path):
    bad_ca = tmp_path / "ca.crt"
    bad_ca.write_text("not a certificate\n")
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="cannot use the TLS files"):
        monitor("https://127.0.0.1:1/api/v1/write", tmp_path, remote_write_ca_file=str(bad_ca))
    assert not (tmp_path / "rec.jsonl").exists()
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("trainer_hook-")]


def test_a_new_run_under_the_same_identity_cancels_the_stale_markers(tmp_path):
    with receiver() as (url, got):
        first = monitor(url, tmp_path, delete_after=5.0)
        first.close()
        deletion = push._deletions[first._writer._group]
        again = monitor(url, tmp_path, delete_after=0)
        deletion.thread.join(10)
        assert deletion.cancelled.is_set() and not deletion.thread.is_alive()
        again.close()
        processes.wait_until(lambda: any(is_stale(s[-1][1]) for r in got for s in r.series.values()), 30,
                             what="the second run's own stale markers")
    assert sum(any(is_stale(s[-1][1]) for s in r.series.values()) for r in got) == 1
