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
- Requests go over one requests.Session per endpoint (session()), which keeps connections open: at
  thousands of ranks pushing every few seconds, a TCP and TLS handshake per push is load on the
  Pushgateway. send() is the one way to use it: no redirects, no retries, one-line RequestFailed.

requests and the standard library only (no torch), in the hook's package, the lower layer: the hook
(settings, push, remote write) and the `dualtrack` command (janitor, report, explain) use it.
"""
from __future__ import annotations

import base64
import http.client
import http.cookiejar
import ipaddress
import os
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests
import requests.adapters
import requests.auth
import requests.utils

from .text import one_line


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
    `_PASSWORD`, `_TOKEN` (else the first line of `_TOKEN_FILE`), `_CA_FILE`. `url` None: no endpoint,
    the credentials are still checked. Raises ValueError with one line that never holds a secret."""
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


class RequestFailed(OSError):
    """A request without a 2xx answer, as one line that holds no credentials and no query: the HTTP
    status and what came back with it, or, for no answer at all, the error underneath requests'."""

    def __init__(self, message: str, status: int | None = None, headers: Mapping[str, str] | None = None,
                 body: bytes = b"", cause: BaseException | None = None) -> None:
        super().__init__(one_line(message))
        self.status = status  # None: no answer (refused, reset, TLS, a timeout)
        self.headers: Mapping[str, str] = headers or {}
        self.body = body  # the first bytes of the answer (MAX_ERROR_BODY)
        self.cause = cause


#: The bytes of an error answer kept (its first line goes into a message).
MAX_ERROR_BODY = 200
_REDIRECT = "redirect not followed (point the URL at the final address)"


class _Authorization(requests.auth.AuthBase):
    """The endpoint's Authorization header on every request of the session; repr() shows no secret."""

    def __init__(self, value: str) -> None:
        self._value = value

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = self._value
        return request

    def __repr__(self) -> str:
        return "_Authorization(***)"


class _TLSAdapter(requests.adapters.HTTPAdapter):
    """https:// with the endpoint's own SSLContext (ssl_context()), directly or through a proxy."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self._context = context  # before HTTPAdapter.__init__, which makes the pool manager
        super().__init__(max_retries=0)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, ssl_context=self._context, **kwargs)

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        return super().proxy_manager_for(proxy, ssl_context=self._context, **kwargs)


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    """No cookie is ever kept: the session holds no state a request changes (safe on several threads),
    and a cookie an auth proxy sets (a credential) is never stored or sent back."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False


def session(endpoint: Endpoint) -> requests.Session:
    """A requests.Session for `endpoint` that keeps its connections open across requests (one TCP and
    TLS handshake per connection, not per push). Raises ValueError for unusable TLS files.

    What requests would do by itself, and what this session does instead:
    - `trust_env` is off: no ~/.netrc credentials (only the endpoint's own go out) and no
      $REQUESTS_CA_BUNDLE / $CURL_CA_BUNDLE (the CA is the system's or the endpoint's ca_file); proxies
      are still taken from $http_proxy/$https_proxy/$no_proxy, once, for the endpoint's URL (as urllib did);
    - https:// uses ssl_context(): the system's CAs or the ca_file, the client certificate, tls_verify;
    - redirects are never followed (send() passes allow_redirects=False: a 3xx is a RequestFailed),
      so the Authorization header goes to the endpoint's host only, whatever a redirect says;
    - nothing is retried (max_retries=0, requests' default): the hook retries on its own schedule
      (the next push; remote write's backoff with jitter and Retry-After);
    - no cookies are kept, and answers are asked for uncompressed (size caps count what is read).
    A session has no per-request state, and urllib3's pool is thread-safe: one thread may use it while
    another's request is in flight (a final push while a stalled one times out).
    """
    context = ssl_context(endpoint)
    client = requests.Session()
    client.trust_env = False
    client.proxies = requests.utils.get_environ_proxies(endpoint.url or "")
    client.cookies.set_policy(_NoCookies())
    client.headers["Accept-Encoding"] = "identity"
    if context is not None:
        # urllib3 matches the certificate to the host itself when the context does not: urllib3 1.x
        # cannot have ssl do it for an IP address (it hands ssl no server_hostname for one)
        context.check_hostname = False
        client.mount("https://", _TLSAdapter(context))
        # requests < 2.32 adds its own CA bundle to the context unless told which file to verify with
        client.verify = (endpoint.ca_file or True) if endpoint.tls_verify else False
    if endpoint.authorization:
        client.auth = _Authorization(endpoint.authorization)
    return client


def send(client: requests.Session, method: str, url: str, timeout: float | None, data: bytes | None = None,
         headers: Mapping[str, str] | None = None, stream: bool = False) -> requests.Response:
    """One request without redirects: its 2xx answer (the body read unless `stream`: then the caller
    reads `raw` and closes it), else RequestFailed (one line; a 3xx says the redirect was not followed)."""
    try:
        response = client.request(method, url, data=data, headers=headers, timeout=timeout,
                                  allow_redirects=False, stream=True)
        if response.status_code < 300:
            if not stream:
                response.content  # noqa: B018 - read now, so failures are RequestFailed too
            return response
    except (requests.RequestException, OSError, http.client.HTTPException) as exc:  # what urllib3 may not wrap
        raise no_answer(exc, timeout) from None
    with response:
        try:
            body = response.raw.read(MAX_ERROR_BODY)
        except Exception:  # noqa: BLE001 - the status says enough; the body broke off
            body = b""
    status = response.status_code
    message = f"HTTP {status} {response.reason or ''}".rstrip()
    raise RequestFailed(f"{message}: {_REDIRECT}" if 300 <= status < 400 else message, status,
                        response.headers, body)


def no_answer(exc: BaseException, timeout: float | None) -> RequestFailed:
    """The RequestFailed of a request or read that got no (whole) answer, naming what is under requests'
    and urllib3's wrappers (ConnectionRefusedError, an SSL error, RemoteDisconnected, a timeout): their
    own text repeats the URL, its query and the pool's details."""
    cause = failure(exc)
    if isinstance(cause, TimeoutError) and timeout is not None:
        return RequestFailed(f"TimeoutError: no answer within {timeout:g} s", cause=cause)
    return RequestFailed(f"{type(cause).__name__}: {str(cause)[:MAX_ERROR_BODY]}", cause=cause)


def failure(exc: BaseException) -> BaseException:
    """The exception under requests' and urllib3's wrappers (MaxRetryError, ProtocolError...)."""
    for _ in range(8):
        if type(exc).__module__.partition(".")[0] not in ("requests", "urllib3"):
            break
        reason = getattr(exc, "reason", None)
        inner = reason if isinstance(reason, BaseException) else next(
            (arg for arg in exc.args if isinstance(arg, BaseException)), exc.__cause__ or exc.__context__)
        if inner is None:
            break
        exc = inner
    return exc


def push_handler(client: requests.Session) -> Callable[..., Callable[[], None]]:
    """A prometheus_client push/delete handler sending over `client` (session()): a failed request
    raises RequestFailed."""
    def handler(url: str, method: str, timeout: float | None, headers: list[tuple[str, str]],
                data: bytes | None) -> Callable[[], None]:
        def push() -> None:
            send(client, method, url, timeout, data, dict(headers))
        return push

    return handler
