"""The exporter's authentication: basic auth against bcrypt hashes, and client certificate SANs.

Basic auth follows exporter-toolkit v0.17.1 (web/handler.go): bcrypt runs one check at a time, an
unknown user is checked against a dummy hash so timing does not tell which users exist, and checks
are cached by (user, hash, password). Differences: only successes are cached (failures always pay
bcrypt), the cache key is a SHA-256 of that triple and the cache keeps the 64 most recently used.
A password over 72 bytes (bcrypt's limit) is refused before bcrypt: Go's bcrypt compares only its
first 72 bytes, and Python's bcrypt 5 raises on it.
"""
from __future__ import annotations

import base64
import binascii
import socket
import threading
from collections import OrderedDict

AUTH_CACHE_SIZE = 64
MAX_PASSWORD_BYTES = 72  # bcrypt reads no more


class Authenticator:
    """Basic-auth check against bcrypt hashes, with successful checks cached.

    bcrypt costs ~100-250 ms by design; a Prometheus scrape every 15 s must not pay that each time, so
    a success is remembered under a SHA-256 of (user, hash, password). Failures are not cached, and
    bcrypt runs one check at a time, so a password-guessing flood costs at most one core.
    """

    def __init__(self, users: dict[str, bytes], cache: bool = True) -> None:
        import hashlib  # here, not at start: an exporter without basic auth loads neither (nor libcrypto)

        import bcrypt
        self._bcrypt = bcrypt
        self._sha256 = hashlib.sha256
        self._users = users
        self._cache: OrderedDict[bytes, None] | None = OrderedDict() if cache else None
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        self._dummy: bytes | None = None

    def check(self, header: str | None) -> bool:
        """True when the Authorization header carries a configured user and its password."""
        user, password = _basic_credentials(header)
        if user is None or len(password) > MAX_PASSWORD_BYTES:
            return False
        hashed = self._users.get(user)
        key = self._sha256(repr((user, hashed, password)).encode()).digest()
        if hashed is not None and self._cache is not None:
            with self._cache_lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    return True
        with self._bcrypt_lock:
            if hashed is None:
                self._bcrypt.checkpw(password, self._dummy_hash())
                return False
            ok = self._bcrypt.checkpw(password, hashed)
        if ok and self._cache is not None:
            with self._cache_lock:
                self._cache[key] = None
                if len(self._cache) > AUTH_CACHE_SIZE:
                    self._cache.popitem(last=False)
        return ok

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
    names = {value for _, value in (cert or {}).get("subjectAltName", ())}
    return bool(names & set(allowed_sans))
