"""HTTP endpoints that take credentials (the Pushgateway, Prometheus): one rule for all of them.

- A URL is http(s)://host[:port][/path]; credentials in it (`user:pass@`) are refused, and no error
  message ever repeats the URL's userinfo, query or fragment.
- Credentials come from arguments or the environment (`<PREFIX>_USERNAME`/`_PASSWORD`, `_TOKEN` or
  `_TOKEN_FILE` (a mounted secret),
  `_CA_FILE`), never from the URL; `repr()` of a resolved Endpoint shows no secret.
- A CA file or client certificate with an http:// URL is an error (it would be silently unused);
  credentials over plain http:// to a host other than loopback are refused (InsecureCredentials, one
  line) unless the caller opts in (`allow_insecure_credentials`, $DUALTRACK_ALLOW_INSECURE_CREDENTIALS=1),
  then warned about once per URL; TLS without certificate verification is warned about once per URL.
- Requests never follow a redirect (the Authorization header would go wherever the redirect points).

Standard library only (no torch), in the hook's package, the lower layer: the hook (settings, push,
remote write) and the `dualtrack` command (janitor, report, explain) use it.
"""
from __future__ import annotations

import base64
import ipaddress
import os
import ssl
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Endpoint:
    """A checked URL and how to authenticate to it; secrets are left out of repr()."""

    url: str | None
    basic_auth: tuple[str, str] | None = field(default=None, repr=False)
    bearer_token: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    client_cert: tuple[str, str] | None = None
    tls_verify: bool = True

    @property
    def authorization(self) -> str | None:
        """The Authorization header value, if any credentials are set."""
        if self.basic_auth:
            return "Basic " + base64.b64encode(":".join(self.basic_auth).encode()).decode()
        if self.bearer_token:
            return "Bearer " + self.bearer_token
        return None


def shown(url: str) -> str:
    """`url` as it may appear in a message: scheme, host, port and path only (no userinfo, query, fragment)."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    netloc = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{netloc}{parts.path}"


def mix_up(url: str, wanted: str) -> str:
    """What a 404 from `url` most likely means when it should be a `wanted` ("Pushgateway", which takes
    pushes, or "Prometheus", which answers queries): it is the other one. Both answer 404 to the other's
    requests."""
    other = "Prometheus" if wanted == "Pushgateway" else "a Pushgateway"
    return (f"{shown(url)} answered 404, so it is no {wanted}: is it {other}? The Pushgateway takes pushes "
            "(port 9091 by default), Prometheus answers queries (port 9090)")


def check_url(what: str, value: Any) -> str:
    """`value` as an http(s) base URL without a trailing slash (http:// is assumed when no scheme is
    given); raises ValueError with one line that never repeats credentials."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a URL like http://host:port")
    url = value.strip()
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError(f"{what} URL is malformed (e.g. an unclosed [IPv6 address])") from None
    if "@" in parts.netloc:
        raise ValueError(f"{what} URL must not contain credentials (user:password@): give the URL as "
                         f"{shown(url)} and the credentials as the username/password or token settings")
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise ValueError(f"{what} URL {shown(url)!r} has an invalid port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} must be an http(s) URL like http://host:port, got {shown(url)!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"{what} URL {shown(url)!r} must not have a query or fragment")
    return (parts.scheme + url[len(parts.scheme):]).rstrip("/")  # HTTPS:// -> https://


def resolve(what: str, env_prefix: str, url: str | None, basic_auth: Any = None, bearer_token: str | None = None,
            ca_file: str | None = None, client_cert: Any = None, tls_verify: bool = True) -> Endpoint:
    """An Endpoint from arguments; each credential left None falls back to `<env_prefix>_USERNAME`/
    `_PASSWORD`, `_TOKEN` (else the first line of `_TOKEN_FILE`), `_CA_FILE`. `url` None: no endpoint, the credentials are still checked.
    Raises ValueError with one line that never holds a secret."""
    env = os.environ
    url = None if url is None else check_url(what, url)
    if basic_auth is None and env.get(f"{env_prefix}_USERNAME"):
        basic_auth = (env[f"{env_prefix}_USERNAME"], env.get(f"{env_prefix}_PASSWORD", ""))
    if basic_auth is not None and (isinstance(basic_auth, str) or len(basic_auth) != 2
                                   or not all(isinstance(p, str) for p in basic_auth)):
        raise ValueError(f"{what}: basic_auth must be a (username, password) pair of strings")
    if bearer_token is None:
        bearer_token = env.get(f"{env_prefix}_TOKEN") or None
        token_file = env.get(f"{env_prefix}_TOKEN_FILE")
        if bearer_token is None and token_file:
            bearer_token = read_secret(Path(token_file), f"${env_prefix}_TOKEN_FILE") or None
    if basic_auth and bearer_token:
        raise ValueError(f"{what}: give either basic_auth or bearer_token, not both")
    ca_file = ca_file if ca_file is not None else env.get(f"{env_prefix}_CA_FILE") or None
    if ca_file is not None and not Path(ca_file).is_file():
        raise ValueError(f"{what}: ca_file {ca_file!r} does not exist")
    if client_cert is not None and (len(client_cert) != 2 or not all(Path(p).is_file() for p in client_cert)):
        raise ValueError(f"{what}: client_cert must be a (certfile, keyfile) pair of existing files")
    if url is not None and url.startswith("http://") and (ca_file or client_cert):
        raise ValueError(f"{what} URL {shown(url)} is plain http://: a ca_file or client_cert needs https:// "
                         "(it would not be used)")
    return Endpoint(url, tuple(basic_auth) if basic_auth else None, bearer_token, ca_file,
                    tuple(client_cert) if client_cert else None, bool(tls_verify))


def read_secret(path: Path | None, flag: str) -> str | None:
    """The first line of a password or token file (never shown in an error)."""
    if path is None:
        return None
    try:
        return next(iter(path.read_text(encoding="utf-8").splitlines()), "").strip()
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {str(path)!r} is not UTF-8 text") from None


def is_loopback(url: str) -> bool:
    """The URL's host is this machine (localhost or a loopback address)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: The opt-in for credentials over plain http:// to another host (a lab without TLS): "1", "true", "yes".
ENV_ALLOW_INSECURE = "DUALTRACK_ALLOW_INSECURE_CREDENTIALS"


class InsecureCredentials(ValueError):
    """Credentials would go unencrypted beyond this host, and no one opted in."""


def allow_insecure(value: bool | None = None) -> bool:
    """The opt-in: `value` when given, else $DUALTRACK_ALLOW_INSECURE_CREDENTIALS (1, true, yes)."""
    if value is not None:
        return bool(value)
    return os.environ.get(ENV_ALLOW_INSECURE, "").strip().lower() in ("1", "true", "yes")


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _once(kind: str, url: str) -> bool:
    """True the first time (per process) `kind` is reported for `url`."""
    with _warned_lock:
        if (kind, url) in _warned:
            return False
        _warned.add((kind, url))
        return True


def check_transport(endpoint: Endpoint, what: str, warn: Callable[[str], None], allowed: bool = False) -> None:
    """Refuse credentials over plain http:// to a host other than loopback: InsecureCredentials (one line)
    unless `allowed`, then `warn` once per URL. `warn` once per URL when TLS certificates go unverified."""
    url = endpoint.url or ""
    if endpoint.authorization and url.startswith("http://") and not is_loopback(url):
        if not allowed:
            raise InsecureCredentials(
                f"credentials for the {what} at {shown(url)} would go over plain http:// to another host, "
                f"readable by anyone on the path: use https:// (a lab may opt in: {ENV_ALLOW_INSECURE}=1)")
        if _once("plaintext", url):
            warn(f"credentials for the {what} at {shown(url)} go over plain http:// to another host, "
                 f"readable by anyone on the path ({ENV_ALLOW_INSECURE}): use https://")
    if url.startswith("https://") and not endpoint.tls_verify and _once("unverified", url):
        warn(f"TLS certificate verification is off for the {what} at {shown(url)} (tls_verify=False): "
             "anyone on the path can pose as it and read the credentials and data")


class RedirectRefused(urllib.error.HTTPError):
    """A 3xx answer: never followed."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        raise RedirectRefused(shown(req.full_url), code, f"{msg}: redirect not followed (point the URL at "
                              "the final address)", headers, fp)


def ssl_context(endpoint: Endpoint) -> ssl.SSLContext | None:
    """The TLS context for an https:// endpoint (None for http://); raises ValueError for unusable files."""
    if not (endpoint.url or "").startswith("https://"):
        return None
    try:
        context = ssl.create_default_context(cafile=endpoint.ca_file)
        if endpoint.client_cert:
            context.load_cert_chain(*endpoint.client_cert)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"cannot use the TLS files (CA file / client certificate): {exc}") from None
    if not endpoint.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def push_handler(endpoint: Endpoint) -> Callable[..., Callable[[], bytes]]:
    """A prometheus_client push/delete handler for `endpoint` (opener's TLS, auth, no redirects); the
    request it returns also hands back the response body. Raises ValueError for unusable TLS files."""
    open_ = opener(endpoint)

    def handler(url: str, method: str, timeout: float | None, headers: list[tuple[str, str]],
                data: bytes | None) -> Callable[[], bytes]:
        def send() -> bytes:
            request = urllib.request.Request(url, data=data, method=method)
            for key, value in headers:
                request.add_header(key, value)
            # raises HTTPError (an OSError) for any status >= 400, and for a redirect
            with open_(request, timeout) as response:
                return response.read()
        return send

    return handler


def opener(endpoint: Endpoint) -> Callable[..., Any]:
    """`open(request, timeout)` for `endpoint`: its TLS context and Authorization header, no redirects.

    The response is returned open (use it as a context manager); HTTP errors raise HTTPError.
    Raises ValueError for unusable TLS files (call it before starting anything).
    """
    handlers: list[Any] = [_NoRedirect()]
    context = ssl_context(endpoint)
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    director = urllib.request.build_opener(*handlers)
    authorization = endpoint.authorization

    def open_(request: urllib.request.Request, timeout: float | None) -> Any:
        if authorization:
            request.add_unredirected_header("Authorization", authorization)
        return director.open(request, timeout=timeout)

    return open_
