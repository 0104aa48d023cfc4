"""Pushing snapshots to the Pushgateway from a background thread: latest wins, nothing queues.

A run that ends keeps its final state on the Pushgateway for `delete_after` seconds (long enough for
Prometheus to scrape it), then deletes its group, so the Pushgateway holds only live runs.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import delete_from_gateway, push_to_gateway

from .connection import Endpoint, RequestFailed, mix_up, push_handler, session
from .contract import Snapshot, merge_maxima
from .families import registry_for
from .settings import PUSHGATEWAY_MAX_RANKS, Settings

log = logging.getLogger("trainer_hook")


def make_handler(settings: Settings) -> Callable:
    """The prometheus_client handler for the settings' Pushgateway: trainer_hook.connection's session (TLS,
    auth header, no redirects, its connection kept open from push to push). Raises ValueError for unusable
    TLS files (called at construction, before anything starts)."""
    return push_handler(session(Endpoint(settings.pushgateway, settings.basic_auth, settings.bearer_token,
                                         settings.ca_file, settings.client_cert, settings.tls_verify)))


@dataclass
class _Deletion:
    """A finished run's series, removed by `delete()` when `due` (time.monotonic) comes: its group
    deleted from the Pushgateway, or stale markers written to a remote-write receiver."""

    due: float
    cancelled: threading.Event
    delete: Callable[[], None]
    awaited_at_exit: bool = True
    thread: threading.Thread | None = None


_deletions: dict[tuple, _Deletion] = {}
_deletions_lock = threading.Lock()


def _await_deletions() -> None:
    """At interpreter exit, let the deletions of closed runs happen (each at most delete_after away).

    The final state must stay on the Pushgateway until Prometheus scraped it, so a script that ends
    right after training waits here; Ctrl-C skips the wait (the janitor removes the groups later), and
    a run stopped by Ctrl-C is not waited for at all.
    """
    with _deletions_lock:
        pending = [(d.due, d.thread) for d in _deletions.values() if d.thread is not None and d.awaited_at_exit]
    if not pending:
        return
    wait = max(due for due, _ in pending) - time.monotonic()
    if wait > 1:
        log.warning("waiting %.0f s before exiting: the final state of %d finished run(s) stays visible "
                    "until Prometheus saw it, then it is deleted from the Pushgateway or marked stale by "
                    "remote write (delete_after; Ctrl-C skips, DUALTRACK_DELETE_AFTER=none keeps it)",
                    wait, len(pending))
    try:
        for due, thread in pending:
            thread.join(max(0.0, due - time.monotonic()) + 10.0)
    except KeyboardInterrupt:
        log.warning("exit: did not remove %d finished run(s): `dualtrack janitor` deletes them from the "
                    "Pushgateway later; remote-written series end by themselves", len(pending))


atexit.register(_await_deletions)  # registered first, so it runs after the monitors' own close


def schedule_deletion(group: tuple, delay: float, delete: Callable[[], None], await_at_exit: bool) -> None:
    """Call `delete()` `delay` seconds from now on its own thread, unless cancel_deletion(group) comes
    first (a new run of this process under the same identity); the process waits for it at exit
    unless not `await_at_exit`. `delete` must not raise."""
    deletion = _Deletion(time.monotonic() + delay, threading.Event(), delete, await_at_exit)
    deletion.thread = threading.Thread(target=_delete_when_due, args=(group, deletion),
                                       name="trainer_hook-delete", daemon=True)
    with _deletions_lock:
        _deletions[group] = deletion
    deletion.thread.start()


def _delete_when_due(group: tuple, deletion: _Deletion) -> None:
    if deletion.cancelled.wait(max(0.0, deletion.due - time.monotonic())):
        return
    try:
        deletion.delete()
    finally:
        with _deletions_lock:
            if _deletions.get(group) is deletion:
                del _deletions[group]


def cancel_deletion(group: tuple) -> None:
    """Cancel the pending deletion of `group`, if any."""
    with _deletions_lock:
        deletion = _deletions.pop(group, None)
    if deletion is not None:
        deletion.cancelled.set()


class Pusher:
    """Pushes the latest offered snapshot; a failed push's maxima are carried into the next one."""

    def __init__(self, settings: Settings, handler: Callable) -> None:
        self.settings = settings
        self._url = settings.pushgateway or ""  # a Pusher is made for a Pushgateway only
        self._group = (settings.pushgateway, settings.job, tuple(sorted(settings.grouping_key.items())))
        cancel_deletion(self._group)  # a new run of this process under the same identity keeps its group
        if settings.world_size > PUSHGATEWAY_MAX_RANKS:
            log.warning("this run has %d ranks, past the %d one Pushgateway carries (docs/scaling.md): pushes "
                        "will land late or not at all; write to a remote-write receiver instead "
                        "(remote_write_url= or $DUALTRACK_REMOTE_WRITE_URL: Prometheus, Mimir, VictoriaMetrics...)",
                        settings.world_size, PUSHGATEWAY_MAX_RANKS)
        self.failures = 0
        self._handler = handler
        self._cond = threading.Condition()
        self._pending: Snapshot | None = None
        self._carry: Snapshot | None = None
        self._outage_failures = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="trainer_hook-push", daemon=True)
        self._thread.start()

    def offer(self, snapshot: Snapshot) -> None:
        """Hand over a snapshot; an older one not yet pushed is replaced (its maxima kept)."""
        with self._cond:
            if self._pending is not None:
                snapshot = merge_maxima(self._pending, snapshot)
            self._pending = snapshot
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._stopping or self._pending is None:
                    return
                snapshot, self._pending = self._pending, None
            try:
                self.push(snapshot)
            except Exception:  # a bug here must not end pushing
                log.exception("trainer_hook internal error while pushing; training continues")

    def push(self, snapshot: Snapshot) -> bool:
        """One PUT of the whole state (so a Pushgateway restarted empty is refilled at once)."""
        if self._carry is not None:
            snapshot = merge_maxima(self._carry, snapshot)
            self._carry = None
        snapshot = dataclasses.replace(snapshot, push_failures=self.failures)  # never change a published one
        try:
            push_to_gateway(self._url, job=self.settings.job,
                            registry=registry_for(lambda: snapshot),
                            grouping_key=self.settings.grouping_key,
                            timeout=self.settings.push_timeout, handler=self._handler)
        except Exception as exc:  # noqa: BLE001 - any failure is counted, none may reach training
            self.failures += 1
            self._outage_failures += 1
            self._carry = snapshot
            if self._outage_failures == 1:
                log.warning("push to %s failed: %s; training continues, retrying every %gs "
                            "(counted in training_push_failures_total)", self._url,
                            mix_up(self._url, "Pushgateway") if isinstance(exc, RequestFailed) and exc.status == 404
                            else exc, self.settings.push_interval)
            return False
        if self._outage_failures:
            log.warning("push to %s works again after %d failed pushes", self.settings.pushgateway,
                        self._outage_failures)
            self._outage_failures = 0
        return True

    def push_final(self, snapshot: Snapshot, await_at_exit: bool = True) -> None:
        """Push the final state; then delete the group `delete_after` seconds later (never blocks).

        If the final push failed, the Pushgateway is out of reach: the group is left to the janitor
        (rather than making the process wait at exit for a deletion that would fail too). Without
        `await_at_exit` (a run the user stopped with Ctrl-C) the process does not wait for it either.
        """
        delay = self.settings.delete_after
        if self.push(snapshot) and delay is not None:
            schedule_deletion(self._group, delay, self._delete, await_at_exit)

    def _delete(self) -> None:
        try:
            delete_from_gateway(self._url, job=self.settings.job,
                                grouping_key=self.settings.grouping_key,
                                timeout=self.settings.push_timeout, handler=self._handler)
        except Exception as exc:  # noqa: BLE001 - the run is over; nothing may raise from here
            log.warning("could not delete the finished run's group from %s: %s; `dualtrack janitor` "
                        "removes it later", self.settings.pushgateway, exc)

    def stop(self, timeout: float) -> Snapshot | None:
        """Stop the thread (waiting up to `timeout` s for a push in flight); return what was not pushed."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            pending, self._pending = self._pending, None
        self._thread.join(timeout)
        return pending
