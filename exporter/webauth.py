"""The exporter's authentication: basic auth against bcrypt hashes, and client certificate SANs.

Basic auth follows exporter-toolkit v0.17.1 (web/handler.go): bcrypt runs one check at a time, an
unknown user is checked against a dummy hash so timing does not tell which users exist, and checks
are cached by (user, hash, password). Differences: only successes are cached, the cache key is a
SHA-256 of that triple and the cache keeps the 64 most recently used. A password over 72 bytes
(bcrypt's limit) is refused before bcrypt: Go's bcrypt compares only its first 72 bytes, and Python's
bcrypt 5 raises on it.

A password-guessing flood must not lock out the scraper whose password is right (exporter-toolkit
has no defence here). So, beyond Go's behaviour:
- each source address has a failure budget, FAILURE_BUDGET failed checks per FAILURE_WINDOW seconds;
  past it, its unknown passwords are refused without bcrypt (a cached right password still passes);
- at most MAX_PENDING_CHECKS checks wait for bcrypt; past that, an unknown password is refused at once;
- the transport makes a connection waiting for bcrypt evictable, and a 401 closes its connection.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

AUTH_CACHE_SIZE = 64
MAX_PASSWORD_BYTES = 72  # bcrypt reads no more
#: Failed checks a source address may cost bcrypt per FAILURE_WINDOW seconds.
FAILURE_BUDGET = 10
FAILURE_WINDOW = 60.0
#: Source addresses whose failures are remembered (the oldest are forgotten first): bounded memory.
FAILURE_ADDRESSES = 4096
#: Checks that may wait for the one bcrypt lock; past that an uncached password is refused unchecked.
MAX_PENDING_CHECKS = 4


class Authenticator:
    """Basic-auth check against bcrypt hashes, with successful checks cached.

    bcrypt costs ~100-250 ms by design; a Prometheus scrape every 15 s must not pay that each time, so
    a success is remembered under a SHA-256 of (user, hash, password). Failures are not cached, and
    bcrypt runs one check at a time, so a password-guessing flood costs at most one core; the failure
    budgets and the bound on waiting checks keep that core free for the right password.
    """

    def __init__(self, users: dict[str, bytes], cache: bool = True, *, failure_budget: int = FAILURE_BUDGET,
                 failure_window: float = FAILURE_WINDOW, max_pending: int = MAX_PENDING_CHECKS) -> None:
        import hashlib  # here, not at start: an exporter without basic auth loads neither (nor libcrypto)

        import bcrypt
        self._bcrypt = bcrypt
        self._sha256 = hashlib.sha256
        self._users = users
        self._cache: OrderedDict[bytes, None] | None = OrderedDict() if cache else None
        self._lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        self._dummy: bytes | None = None
        self._failure_budget = failure_budget
        self._failure_window = failure_window
        self._max_pending = max_pending
        self._pending = 0  # checks waiting for, or holding, the bcrypt lock
        # source address -> (start of its current window, failures in it), oldest first
        self._failures: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def check(self, header: str | None, client: str = "",
              waiting: Callable[[], contextlib.AbstractContextManager[None]] | None = None) -> bool:
        """True when the Authorization header carries a configured user and its password.

        `client` is the source address its failures are charged to; `waiting()`, when given, is entered
        while the check waits for bcrypt (the transport makes the connection evictable meanwhile).
        """
        user, password = _basic_credentials(header)
        if user is None or len(password) > MAX_PASSWORD_BYTES:
            return False
        hashed = self._users.get(user)
        key = self._sha256(repr((user, hashed, password)).encode()).digest()
        if hashed is not None and self._cache is not None:
            with self._lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    return True
        with self._lock:
            if self._over_budget(client) or self._pending >= self._max_pending:
                self._charge(client)
                return False
            self._pending += 1
        try:
            with waiting() if waiting is not None else contextlib.nullcontext():
                self._bcrypt_lock.acquire()
            try:
                ok = self._checkpw_locked(password, hashed)
            finally:
                self._bcrypt_lock.release()
        finally:
            with self._lock:
                self._pending -= 1
        with self._lock:
            if not ok:
                self._charge(client)
            elif self._cache is not None:
                self._cache[key] = None
                if len(self._cache) > AUTH_CACHE_SIZE:
                    self._cache.popitem(last=False)
        return ok

    def _checkpw_locked(self, password: bytes, hashed: bytes | None) -> bool:
        if hashed is None:
            self._bcrypt.checkpw(password, self._dummy_hash())
            return False
        return self._bcrypt.checkpw(password, hashed)

    def _over_budget(self, client: str) -> bool:
        """Whether `client` spent its failure budget in its current window (under the lock)."""
        start, failures = self._failures.get(client, (0.0, 0))
        return failures >= self._failure_budget and time.monotonic() - start < self._failure_window

    def _charge(self, client: str) -> None:
        """Count a failed check against `client` (under the lock)."""
        now = time.monotonic()
        start, failures = self._failures.pop(client, (now, 0))
        if now - start >= self._failure_window:
            start, failures = now, 0
        self._failures[client] = (start, failures + 1)
        if len(self._failures) > FAILURE_ADDRESSES:
            self._failures.popitem(last=False)

    def _dummy_hash(self) -> bytes:
        if self._dummy is None:
            cost = int(next(iter(self._users.values())).split(b"$")[2])
            self._dummy = self._bcrypt.hashpw(b"dualtrack-no-such-user", self._bcrypt.gensalt(cost))
        return self._dummy


def _basic_credentials(header: str | None) -> tuple[str | None, bytes]:
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return None, b""
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).partition(b":")
        return (user.decode("utf-8"), password) if sep else (None, b"")
    except (binascii.Error, UnicodeDecodeError):
        return None, b""


def san_allowed(connection: socket.socket, allowed_sans: tuple[str, ...]) -> bool:
    """True when the connection's verified client certificate names one of `allowed_sans` (only a TLS
    connection has one: SANs are only allowed with TLS, which has loaded `ssl`)."""
    import ssl
    cert = connection.getpeercert() if isinstance(connection, ssl.SSLSocket) else None
    entries = (cert or {}).get("subjectAltName", ())  # ((type, value), ...), e.g. (("DNS", "host"),)
    names = {entry[1] for entry in entries if isinstance(entry, tuple)}
    return bool(names & set(allowed_sans))
