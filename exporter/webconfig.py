"""The `--web.config.file`: TLS and basic auth in the Prometheus exporter-toolkit format.

See https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md (the format
as of exporter-toolkit v0.17.1; its `rate_limit` is not supported). Supported:
`tls_server_config` (cert_file/key_file or inline cert/key, client_auth_type, client_ca_file or
inline client_ca, client_allowed_sans, min_version, max_version, prefer_server_cipher_suites),
`http_server_config` (headers; http2 is accepted, HTTP/1.1 is served) and `basic_auth_users`
(bcrypt hashes only). Everything else is rejected by name, so a setting is never silently ignored.
Relative file names are resolved against the config file's directory, as exporter-toolkit does.
"""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

HASH_HINT = "make one with: python -c \"import bcrypt; print(bcrypt.hashpw(b'PASSWORD', bcrypt.gensalt()).decode())\""
_BCRYPT_HASH = re.compile(r"\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}")

_TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users"}
_TLS_KEYS = {"cert_file", "key_file", "cert", "key", "client_auth_type", "client_ca_file", "client_ca",
             "client_allowed_sans", "min_version", "max_version", "prefer_server_cipher_suites"}
_TLS_UNSUPPORTED = {"cipher_suites", "curve_preferences"}
_HTTP_KEYS = {"headers", "http2"}
# `ssl` (and libcrypto, 3.5 MB resident) is imported only for a config that enables TLS: names of its constants.
_TLS_VERSIONS = {"TLS10": "TLSv1", "TLS11": "TLSv1_1", "TLS12": "TLSv1_2", "TLS13": "TLSv1_3"}
# exporter-toolkit's client_auth_type names; the two that request a certificate without verifying it
# cannot be expressed with Python's ssl module (and exporter-toolkit itself calls them insecure).
_CLIENT_AUTH = {"NoClientCert": "CERT_NONE", "VerifyClientCertIfGiven": "CERT_OPTIONAL",
                "RequireAndVerifyClientCert": "CERT_REQUIRED"}
_CLIENT_AUTH_UNSUPPORTED = {"RequestClientCert", "RequireAnyClientCert"}
# exporter-toolkit only allows these response headers, with these values where it restricts them.
_HEADER_VALUES: dict[str, set[str] | None] = {
    "Content-Security-Policy": None, "X-Frame-Options": {"deny", "sameorigin"},
    "X-Content-Type-Options": {"nosniff"}, "X-XSS-Protection": None, "Strict-Transport-Security": None,
}


class WebConfigError(ValueError):
    """The web config file is unusable; the message is one line naming the problem."""


@dataclass(frozen=True)
class WebConfig:
    """A loaded web config: an SSL context when TLS is on, bcrypt hashes by user, extra headers."""

    ssl_context: ssl.SSLContext | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    client_allowed_sans: tuple[str, ...] = ()


def load_web_config(path: str) -> WebConfig:
    """Read and check the web config at `path`; raise WebConfigError with one clear line."""
    import yaml  # here, not at start: an exporter without --web.config.file never loads it
    where = f"web config {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WebConfigError(f"{where}: cannot read: {_reason(exc)}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "parse error"
        raise WebConfigError(f"{where}: invalid YAML{at}: {_one_line(problem)}") from None
    base = Path(path).resolve().parent
    top = _mapping(data if data is not None else {}, where, _TOP_KEYS)
    http = _mapping(top.get("http_server_config") or {}, f"{where}: http_server_config", _HTTP_KEYS)
    if not isinstance(http.get("http2", True), bool):
        raise WebConfigError(f"{where}: http_server_config.http2 must be true or false")
    tls = _mapping(top.get("tls_server_config") or {}, f"{where}: tls_server_config", _TLS_KEYS, _TLS_UNSUPPORTED)
    return WebConfig(
        ssl_context=_ssl_context(tls, base, f"{where}: tls_server_config"),
        users=_users(top.get("basic_auth_users") or {}, f"{where}: basic_auth_users"),
        headers=_headers(http.get("headers") or {}, f"{where}: http_server_config.headers"),
        client_allowed_sans=tuple(_string_list(tls.get("client_allowed_sans"),
                                               f"{where}: tls_server_config.client_allowed_sans")),
    )


def _mapping(value: Any, where: str, allowed: Set[str], unsupported: Set[str] = frozenset()) -> dict:
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    for key in value:
        if key in unsupported:
            raise WebConfigError(f"{where}: {key} is not supported by dualtrack-exporter "
                                 "(OpenSSL defaults apply); remove it")
        if key not in allowed:
            raise WebConfigError(f"{where}: unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise WebConfigError(f"{where} must be a non-empty string")
    return value


def _string_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise WebConfigError(f"{where} must be a list of strings")
    return value


def _file(value: Any, base: Path, where: str) -> str:
    path = base / _string(value, where)
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise WebConfigError(f"{where} {str(path)!r}: {_reason(exc)}") from None
    return str(path)


def _ssl_context(tls: dict, base: Path, where: str) -> ssl.SSLContext | None:
    has_cert = bool(tls.get("cert_file") or tls.get("cert"))
    has_key = bool(tls.get("key_file") or tls.get("key"))
    if not has_cert and not has_key:
        if tls:  # settings without a certificate would silently serve plain HTTP
            raise WebConfigError(f"{where}: cert_file and key_file are required to enable TLS")
        return None
    for file_key, inline_key in (("cert_file", "cert"), ("key_file", "key"), ("client_ca_file", "client_ca")):
        if tls.get(file_key) and tls.get(inline_key):
            raise WebConfigError(f"{where}: set {file_key} or {inline_key}, not both")
    if not has_cert or not has_key:
        missing = "cert_file" if not has_cert else "key_file"
        raise WebConfigError(f"{where}: {missing} is missing (both cert_file and key_file are needed)")

    import ssl
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _tls_version(tls.get("min_version", "TLS12"), f"{where}.min_version")
    context.maximum_version = _tls_version(tls.get("max_version", "TLS13"), f"{where}.max_version")
    if context.minimum_version > context.maximum_version:
        raise WebConfigError(f"{where}: min_version is above max_version")
    if tls.get("prefer_server_cipher_suites", True):
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    _load_chain(context, tls, base, where)
    _client_auth(context, tls, base, where)
    return context


def _tls_version(value: Any, where: str) -> ssl.TLSVersion:
    if value not in _TLS_VERSIONS:
        raise WebConfigError(f"{where}: {value!r} is not one of {', '.join(_TLS_VERSIONS)}")
    import ssl
    return getattr(ssl.TLSVersion, _TLS_VERSIONS[value])


def _load_chain(context: ssl.SSLContext, tls: dict, base: Path, where: str) -> None:
    """Load the server certificate and key, from files or from inline PEM strings."""
    import ssl
    with tempfile.TemporaryDirectory(prefix="dualtrack-tls-") as tmp:
        paths = {}
        for file_key, inline_key in (("cert_file", "cert"), ("key_file", "key")):
            if tls.get(file_key):
                paths[file_key] = _file(tls[file_key], base, f"{where}.{file_key}")
            else:  # ssl can only load a chain from files: write the inline PEM to a private temp file
                paths[file_key] = os.path.join(tmp, inline_key + ".pem")
                fd = os.open(paths[file_key], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as out:
                    out.write(_string(tls[inline_key], f"{where}.{inline_key}"))
        try:
            context.load_cert_chain(paths["cert_file"], paths["key_file"])
        except (ssl.SSLError, OSError) as exc:
            raise WebConfigError(f"{where}: cannot load the certificate and key "
                                 f"(PEM files? key matching the certificate?): {_reason(exc)}") from None


def _client_auth(context: ssl.SSLContext, tls: dict, base: Path, where: str) -> None:
    import ssl
    auth_type = tls.get("client_auth_type", "NoClientCert")
    if auth_type in _CLIENT_AUTH_UNSUPPORTED:
        raise WebConfigError(f"{where}.client_auth_type: {auth_type} (a certificate without verification) is "
                             "not supported; use RequireAndVerifyClientCert or VerifyClientCertIfGiven")
    if auth_type not in _CLIENT_AUTH:
        raise WebConfigError(f"{where}.client_auth_type: {auth_type!r} is not one of "
                             f"{', '.join([*_CLIENT_AUTH, *_CLIENT_AUTH_UNSUPPORTED])}")
    has_ca = bool(tls.get("client_ca_file") or tls.get("client_ca"))
    if auth_type == "NoClientCert":
        if has_ca or tls.get("client_allowed_sans"):
            raise WebConfigError(f"{where}: client_ca_file/client_allowed_sans need a client_auth_type "
                                 "that verifies client certificates")
        return
    if not has_ca:
        raise WebConfigError(f"{where}: client_auth_type {auth_type} needs client_ca_file or client_ca")
    if tls.get("client_allowed_sans") and auth_type != "RequireAndVerifyClientCert":
        raise WebConfigError(f"{where}: client_allowed_sans needs client_auth_type RequireAndVerifyClientCert")
    try:
        if tls.get("client_ca_file"):
            context.load_verify_locations(cafile=_file(tls["client_ca_file"], base, f"{where}.client_ca_file"))
        else:
            context.load_verify_locations(cadata=_string(tls["client_ca"], f"{where}.client_ca"))
    except (ssl.SSLError, ValueError) as exc:
        raise WebConfigError(f"{where}: cannot load the client CA: {_reason(exc)}") from None
    context.verify_mode = getattr(ssl, _CLIENT_AUTH[auth_type])


def _users(users: Any, where: str) -> dict[str, bytes]:
    if not isinstance(users, dict):
        raise WebConfigError(f"{where}: expected a mapping of user name to bcrypt hash")
    checked = {}
    for user, hashed in users.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(f"{where}: user name {user!r} must be a non-empty string without ':'")
        if not isinstance(hashed, str) or not _BCRYPT_HASH.fullmatch(hashed):
            raise WebConfigError(f"{where}.{user}: the password must be a bcrypt hash, not plain text ({HASH_HINT})")
        checked[user] = hashed.encode("ascii")
    return checked


def _headers(headers: Any, where: str) -> dict[str, str]:
    headers = _mapping(headers, where, set(_HEADER_VALUES))
    checked = {}
    for name, value in headers.items():
        if value in (None, ""):
            continue  # exporter-toolkit: unset if blank
        if not isinstance(value, str) or not value.isascii() or not value.isprintable():
            raise WebConfigError(f"{where}.{name} must be a single line of printable ASCII")
        allowed = _HEADER_VALUES[name]
        if allowed is not None and value.lower() not in allowed:
            raise WebConfigError(f"{where}.{name}: {value!r} is not one of {', '.join(sorted(allowed))}")
        checked[name] = value
    return checked


def _reason(exc: BaseException) -> str:
    return _one_line(getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc) or type(exc).__name__)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())
