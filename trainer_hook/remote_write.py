"""Prometheus Remote-Write 1.0 from the hook's own background thread: no Pushgateway, no janitor.

Every published snapshot becomes one batch of samples stamped with the hook's publish time, carrying
the series and labels Prometheus stores when it scrapes the Pushgateway with honor_labels (the
grouping labels job/run/rank/instance on every series; `le` written as the Pushgateway writes it).
Batches wait in a bounded queue (the oldest is dropped, and counted, when it is full); a sender thread
POSTs them, several at a time, as snappy-compressed protobuf WriteRequests. 5xx, 429 and network
errors are retried a bounded number of times, after the receiver's `Retry-After` (seconds or an HTTP
date, on 429 and 503; at most MAX_RETRY_AFTER) or else a capped exponential backoff with full jitter
(a random wait up to the backoff: many ranks do not retry in step); any other 4xx is the
receiver refusing the data: dropped, counted in training_push_failures_total, warned about once.
The training thread never waits on any of it (close() waits at most push_timeout + 1 s, as the
Pushgateway's final push does).

The final state is followed by stale markers `delete_after` seconds later (the spec's end of a
series), sent when that time comes, as the Pushgateway path deletes its group then (trainer_hook.push's
deletion schedule: cancelled by a new run of the process under the same identity, awaited at exit):
queries see the final state as long as they would through the Pushgateway, and nothing after.

Needs `pip install 'dualtrack[remote-write]'` (protobuf and cramjam); the message types are built
from prometheus/prompb's types.proto (Label, Sample, TimeSeries) and remote.proto (WriteRequest)
at first use.
"""
from __future__ import annotations

import email.utils
import logging
import math
import random
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NamedTuple

from prometheus_client.utils import floatToGoString

from . import protobuf
from .connection import Endpoint, RequestFailed, send, session, shown
from .contract import Snapshot
from .families import families
from .protobuf import DOUBLE, INT64, MESSAGE, STRING, Schema
from .push import cancel_deletion, schedule_deletion
from .settings import Settings
from .text import one_line

log = logging.getLogger("trainer_hook")

PROTOCOL_VERSION = "0.1.0"
#: The spec's staleness marker: a NaN no real sample may carry.
STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]
#: Batches (one per push interval) held while the receiver is slow or away: 10 min at 5 s.
MAX_QUEUED_BATCHES = 120
#: Batches sent in one request once a backlog built up.
MAX_BATCHES_PER_REQUEST = 12
#: Tries of one request on 5xx, 429 or a network error; then it is dropped and counted.
MAX_ATTEMPTS = 5
FIRST_BACKOFF = 0.5
MAX_BACKOFF = 30.0
#: The longest Retry-After honoured (seconds); a longer one waits this long.
MAX_RETRY_AFTER = 300.0
#: Label values the Pushgateway re-exposes as numbers (Go's shortest float format).
_NUMERIC_LABELS = ("le", "quantile")

Labels = tuple[tuple[str, str], ...]


class Batch(NamedTuple):
    """One snapshot's samples: (sorted labels with __name__, value), all at `timestamp_ms`."""

    timestamp_ms: int
    samples: tuple[tuple[Labels, float], ...]


# --------------------------------------------------------------------------- the protocol's messages
#: prompb's types.proto and remote.proto: the messages and fields Remote-Write 1.0 uses
_SCHEMA: Schema = {
    "WriteRequest": (("timeseries", 1, MESSAGE, True, "TimeSeries"),),
    "TimeSeries": (("labels", 1, MESSAGE, True, "Label"), ("samples", 2, MESSAGE, True, "Sample")),
    "Label": (("name", 1, STRING, False, ""), ("value", 2, STRING, False, "")),
    "Sample": (("value", 1, DOUBLE, False, ""), ("timestamp", 2, INT64, False, "")),
}
_messages: dict[str, type] = {}


def messages() -> dict[str, type]:
    """The prompb message classes by name, built once; raises ValueError when protobuf is missing."""
    if not _messages:
        try:
            _messages.update(protobuf.messages("dualtrack/prompb/remote.proto", "prometheus", _SCHEMA))
        except ImportError:
            raise ValueError("remote write needs protobuf and cramjam: "
                             "pip install 'dualtrack[remote-write]'") from None
    return _messages


def _snappy() -> Any:
    try:
        import cramjam
    except ImportError:
        raise ValueError("remote write needs protobuf and cramjam: "
                         "pip install 'dualtrack[remote-write]'") from None
    return cramjam.snappy


def _go_float(text: str) -> str:
    """A numeric label value as the Pushgateway re-exposes it (Go's shortest format): "1.0" -> "1",
    "0.25" -> "0.25", "1e6" -> "1e+06" (floatToGoString, less the ".0" it keeps)."""
    shortest = floatToGoString(text)
    return shortest[:-2] if shortest.endswith(".0") else shortest


def batch(snapshot: Snapshot, identity: dict[str, str], timestamp: float) -> Batch:
    """The samples Prometheus would store for `snapshot` pushed under `identity`, at `timestamp`."""
    samples = []
    for family in families(snapshot, {}):
        for sample in family.samples:
            labels = {name: (_go_float(value) if name in _NUMERIC_LABELS else value)
                      for name, value in sample.labels.items()}
            labels.update(identity)
            labels["__name__"] = sample.name
            value = float(sample.value)
            samples.append((tuple(sorted((k, v) for k, v in labels.items() if v != "")),
                            math.nan if math.isnan(value) else value))  # never the stale marker's NaN
    return Batch(round(timestamp * 1000), tuple(samples))


def stale(series: Iterable[Labels]) -> tuple[tuple[Labels, float], ...]:
    """Stale markers for `series` (at the timestamp of the batch they go into)."""
    return tuple((labels, STALE_NAN) for labels in sorted(series))


def encode(batches: Iterable[Batch]) -> bytes:
    """One snappy-compressed (block format) WriteRequest: a series per label set, its samples in
    time order (one per timestamp, the later batch winning)."""
    series: dict[Labels, dict[int, float]] = {}
    for one in batches:
        for labels, value in one.samples:
            series.setdefault(labels, {})[one.timestamp_ms] = value
    m = messages()
    request = m["WriteRequest"]()
    for labels, points in series.items():
        timeseries = request.timeseries.add()
        timeseries.labels.extend(m["Label"](name=name, value=value) for name, value in labels)
        timeseries.samples.extend(m["Sample"](value=points[ms], timestamp=ms) for ms in sorted(points))
    return bytes(_snappy().compress_raw(request.SerializeToString()))


class RemoteWriter:
    """Queues each offered snapshot as a batch; a daemon thread writes them to the receiver."""

    def __init__(self, settings: Settings, endpoint: Endpoint) -> None:
        """Raises ValueError (missing libraries, unusable TLS files); the thread starts with the first
        batch, so a monitor whose construction fails later leaves nothing behind."""
        messages()
        _snappy()
        self.settings = settings
        self.failures = 0  # requests or batches not accepted: training_push_failures_total
        self._url = endpoint.url or ""  # settings.remote_write gives no endpoint without a URL
        self._session = session(endpoint)  # the sender thread's, and the stale markers' after it
        self._identity = {"job": settings.job, **settings.grouping_key}
        self._group = (endpoint.url, settings.job, tuple(sorted(settings.grouping_key.items())))
        cancel_deletion(self._group)  # a new run of this process under the same identity keeps its series
        self._headers = {"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
                         "X-Prometheus-Remote-Write-Version": PROTOCOL_VERSION,
                         "User-Agent": f"dualtrack-trainer-hook/{_version()}"}
        self._queue: deque[Batch] = deque()
        self._written: set[Labels] = set()  # the series of the latest batch
        self._cond = threading.Condition()
        self._closing = False
        self._abort = threading.Event()  # ends a backoff wait at close
        self._warned_rejected = False
        self._warned_full = False  # since the last accepted write
        self._outage = 0  # consecutive requests given up on
        self._thread = threading.Thread(target=self._run, name="trainer_hook-remote-write", daemon=True)

    # ------------------------------------------------------------------ the monitor's side
    def offer(self, snapshot: Snapshot) -> None:
        """Queue `snapshot`'s samples, stamped with its publish time (the oldest batch goes when full),
        with stale markers for the series the previous batch had and this one has not (as a scrape
        of the Pushgateway would see them go)."""
        current = batch(snapshot, self._identity, snapshot.published)
        series = {labels for labels, _ in current.samples}
        gone, self._written = self._written - series, series
        self._enqueue(current._replace(samples=current.samples + stale(gone)) if gone else current)

    def finish(self, final: Snapshot, await_at_exit: bool = True) -> None:
        """Queue the final state, wait at most push_timeout + 1 s for the queue to be written, then
        schedule stale markers for all its series `delete_after` s later (none if the receiver was
        out of reach: its series end by themselves)."""
        self.offer(final)
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(self.settings.push_timeout + 1.0)
        self._abort.set()
        if self.settings.delete_after is not None and not self._thread.is_alive() and not self._outage:
            schedule_deletion(self._group, self.settings.delete_after, self._mark_stale, await_at_exit)

    def _mark_stale(self) -> None:
        """The end of the run's series: one request of stale markers at the current time."""
        status, detail, _ = self._post(encode([Batch(round(time.time() * 1000), stale(self._written))]))
        if not 200 <= status < 300:
            log.warning("could not mark the finished run's series stale at %s (%s): they end by "
                        "themselves after Prometheus' 5 min lookback", shown(self._url), detail)

    def _enqueue(self, item: Batch) -> None:
        with self._cond:
            if len(self._queue) >= MAX_QUEUED_BATCHES:
                self._queue.popleft()
                self.failures += 1
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("remote write to %s falls behind: dropped the oldest batch of samples "
                                "(queue of %d full); counted in training_push_failures_total",
                                shown(self._url), MAX_QUEUED_BATCHES)
            self._queue.append(item)
            self._cond.notify()
            if self._thread.ident is None:
                self._thread.start()

    # ------------------------------------------------------------------ the sender thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batches = [self._queue.popleft()
                           for _ in range(min(len(self._queue), MAX_BATCHES_PER_REQUEST))]
            try:
                self._write(encode(batches))
            except Exception:  # a bug here must not end writing
                log.exception("trainer_hook internal error in remote write; training continues")

    def _write(self, body: bytes) -> None:
        """POST `body` until accepted, refused (4xx) or MAX_ATTEMPTS retryable failures."""
        delay = FIRST_BACKOFF
        for attempt in range(1, MAX_ATTEMPTS + 1):
            status, detail, retry_after = self._post(body)
            if 200 <= status < 300:
                self._warned_full = False
                if self._outage:
                    log.warning("remote write to %s works again", shown(self._url))
                    self._outage = 0
                return
            if status != 429 and 300 <= status < 500:
                self._count_failure()
                if not self._warned_rejected:
                    self._warned_rejected = True
                    log.warning("remote write to %s refused the samples (%s): dropped; training "
                                "continues (counted in training_push_failures_total, warned once)",
                                shown(self._url), detail)
                return
            wait = random.uniform(0, min(delay, MAX_BACKOFF)) if retry_after is None else retry_after
            if attempt == MAX_ATTEMPTS or self._abort.wait(wait):
                break
            delay *= 2
        self._count_failure()
        if self._outage == 0:
            log.warning("remote write to %s failed %d times (%s): samples dropped; training continues, "
                        "retrying with the next batch (counted in training_push_failures_total)",
                        shown(self._url), attempt, detail)
        self._outage += 1

    def _count_failure(self) -> None:
        with self._cond:  # the worker thread counts queue overflows under the same lock
            self.failures += 1

    def _post(self, body: bytes) -> tuple[int, str, float | None]:
        """(HTTP status, a line for the log, the seconds a 429 or 503 asked to wait); status 0 for a
        network error."""
        try:
            status = send(self._session, "POST", self._url, self.settings.push_timeout, body, self._headers).status_code
            return status, f"HTTP {status}", None
        except RequestFailed as exc:
            if exc.status is None:
                return 0, str(exc), None
            retry_after = retry_after_seconds(exc.headers.get("Retry-After"), time.time())
            answer = exc.body.decode("utf-8", "replace").strip().splitlines()
            shown_answer = one_line(answer[0]) if answer else ""
            return (exc.status, f"HTTP {exc.status}" + (f": {shown_answer}" if shown_answer else ""),
                    retry_after if exc.status in (429, 503) else None)


def retry_after_seconds(value: str | None, now: float) -> float | None:
    """A Retry-After header as seconds to wait from `now` (delay-seconds or an HTTP date), at most
    MAX_RETRY_AFTER; None when absent or unreadable."""
    if not value or not value.strip():
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return min(max(0.0, when.timestamp() - now), MAX_RETRY_AFTER)


def _version() -> str:
    try:
        return version("dualtrack")
    except PackageNotFoundError:
        return "0"
