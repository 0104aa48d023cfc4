"""Pushing snapshots to the Pushgateway from a background thread: latest wins, nothing queues."""
from __future__ import annotations

import base64
import dataclasses
import logging
import ssl
import threading
import urllib.request
from typing import Callable

from prometheus_client import push_to_gateway

from .aggregate import Snapshot, merge_maxima
from .exposition import registry_for
from .settings import Settings

log = logging.getLogger("trainer_hook")


def make_handler(settings: Settings) -> Callable:
    """A prometheus_client push handler with our auth headers and TLS options.

    Raises ValueError for unusable TLS files (called at construction, before anything starts).
    """
    context = None
    if settings.pushgateway and settings.pushgateway.startswith("https"):
        try:
            context = ssl.create_default_context(cafile=settings.ca_file)
            if settings.client_cert:
                context.load_cert_chain(*settings.client_cert)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"cannot use the TLS files (ca_file/client_cert): {exc}") from None
        if not settings.tls_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    auth = None
    if settings.basic_auth:
        auth = "Basic " + base64.b64encode(":".join(settings.basic_auth).encode()).decode()
    elif settings.bearer_token:
        auth = "Bearer " + settings.bearer_token

    def handler(url: str, method: str, timeout: float | None, headers, data: bytes):
        def send() -> None:
            request = urllib.request.Request(url, data=data, method=method)
            for key, value in headers:
                request.add_header(key, value)
            if auth:
                request.add_header("Authorization", auth)
            # urlopen raises HTTPError (an OSError) for any status >= 400.
            with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
                response.read()
        return send

    return handler


class Pusher:
    """Pushes the latest offered snapshot; a failed push's maxima are carried into the next one."""

    def __init__(self, settings: Settings, handler: Callable) -> None:
        self.settings = settings
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
                if self._stopping:
                    return
                snapshot, self._pending = self._pending, None
            try:
                self.push(snapshot)
            except Exception:  # noqa: BLE001 - a bug here must not end pushing
                log.exception("trainer_hook internal error while pushing; training continues")

    def push(self, snapshot: Snapshot) -> bool:
        """One PUT of the whole state (so a Pushgateway restarted empty is refilled at once)."""
        if self._carry is not None:
            snapshot = merge_maxima(self._carry, snapshot)
            self._carry = None
        snapshot = dataclasses.replace(snapshot, push_failures=self.failures)  # never change a published one
        try:
            push_to_gateway(self.settings.pushgateway, job=self.settings.job,
                            registry=registry_for(lambda: snapshot),
                            grouping_key=self.settings.grouping_key,
                            timeout=self.settings.push_timeout, handler=self._handler)
        except Exception as exc:  # noqa: BLE001 - any failure is counted, none may reach training
            self.failures += 1
            self._outage_failures += 1
            self._carry = snapshot
            if self._outage_failures == 1:
                log.warning("push to %s failed: %s; training continues, retrying every %gs "
                            "(counted in training_push_failures_total)", self.settings.pushgateway,
                            exc, self.settings.push_interval)
            return False
        if self._outage_failures:
            log.warning("push to %s works again after %d failed pushes", self.settings.pushgateway,
                        self._outage_failures)
            self._outage_failures = 0
        return True

    def stop(self, timeout: float) -> Snapshot | None:
        """Stop the thread (waiting up to `timeout` s for a push in flight); return what was not pushed."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            pending, self._pending = self._pending, None
        self._thread.join(timeout)
        return pending
