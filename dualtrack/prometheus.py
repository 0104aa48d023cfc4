"""Reading Prometheus' HTTP API for the `dualtrack` commands, with the hook's TLS and auth rules.

Flags (each with an environment fallback, like the hook's DUALTRACK_PUSHGATEWAY_* settings):

    --prometheus URL                     $DUALTRACK_PROMETHEUS
    --prometheus-username USER           $DUALTRACK_PROMETHEUS_USERNAME
    --prometheus-password-file FILE      $DUALTRACK_PROMETHEUS_PASSWORD (the password itself)
    --prometheus-bearer-token-file FILE  $DUALTRACK_PROMETHEUS_TOKEN (the token itself)
    --prometheus-ca-file FILE            $DUALTRACK_PROMETHEUS_CA_FILE
    --prometheus-timeout SECONDS         (default 10)

Passwords and tokens never go on the command line (other users see it in `ps`), and never into a
message, a report or repr(): trainer_hook.connection checks the URL and credentials (and refuses them
over plain http:// to another host unless $DUALTRACK_ALLOW_INSECURE_CREDENTIALS=1).

Each query has a total deadline (connecting, the answer's head and its whole body: a server that
trickles bytes cannot hold it longer) and a size cap; whatever goes wrong on the way (refused, reset,
a bad status line, a truncated body, TLS, a timeout, not JSON) is one QueryError line.
"""
from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import requests
import urllib3

from trainer_hook.connection import (
    Endpoint,
    RequestFailed,
    allow_insecure,
    check_transport,
    mix_up,
    no_answer,
    read_secret,
    resolve,
    send,
    session,
    shown,
)
from trainer_hook.text import one_line

from .console import duration

ENV_URL = "DUALTRACK_PROMETHEUS"
#: Seconds one query may take in all, unless --prometheus-timeout says otherwise.
DEFAULT_TIMEOUT = 10.0
#: The largest answer read (bytes); a larger one is a QueryError.
MAX_ANSWER_BYTES = 32 * 2**20


#: The exporter's scrape job in every shipped deployment. GPU series (nvml_*) are read from it alone, in
#: the rules as in explain: the same names pushed or remote-written under another job say nothing.
EXPORTER_JOB = "dualtrack-exporter"


_GPU_SERIES = re.compile(r"(?<![\w:])(nvml_\w+)(?![\w:])(\{[^{}]*\})?")


def exporter_only(expr: str) -> str:
    """`expr` with every GPU series it reads (nvml_*) selected from the exporter's job alone."""
    def select(found: re.Match) -> str:
        labels = (found.group(2) or "{}")[1:-1].strip()
        if re.search(r"(^|,)\s*job\s*=", labels):
            return found.group(0)
        return f"{found.group(1)}{{job={quote(EXPORTER_JOB)}{', ' + labels if labels else ''}}}"
    return _GPU_SERIES.sub(select, expr)


def quote(value: str) -> str:
    """A PromQL string literal for a label value: double-quoted, `\\`, `"` and newline escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class QueryError(Exception):
    """Prometheus could not be asked or answered nonsense (one line, no credentials)."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))  # a server's text (a bad status line) may hold anything


class _TooLarge(Exception):
    """The answer is larger than the client reads."""


def add_arguments(parser: argparse.ArgumentParser, purpose: str) -> None:
    """The connection flags; `purpose` ends the --prometheus help (what the command does with it)."""
    parser.add_argument("--prometheus", metavar="URL", default=None,
                        help=f"Prometheus base URL, e.g. https://127.0.0.1:9090 (default ${ENV_URL}): {purpose}")
    parser.add_argument("--prometheus-username", metavar="USER", default=None,
                        help=f"basic-auth user (default ${ENV_URL}_USERNAME; password from "
                             f"--prometheus-password-file or ${ENV_URL}_PASSWORD)")
    parser.add_argument("--prometheus-password-file", metavar="FILE", type=Path, default=None,
                        help="file holding the basic-auth password (its first line)")
    parser.add_argument("--prometheus-bearer-token-file", metavar="FILE", type=Path, default=None,
                        help=f"file holding a bearer token (default ${ENV_URL}_TOKEN)")
    parser.add_argument("--prometheus-ca-file", metavar="FILE", default=None,
                        help=f"CA certificate for an https:// URL (default ${ENV_URL}_CA_FILE)")
    parser.add_argument("--prometheus-timeout", metavar="SECONDS", type=functools.partial(duration, positive=True),
                        default=DEFAULT_TIMEOUT, help="the most one query may take, answer included: seconds, "
                        f"or a duration like 500ms or 1m (default {DEFAULT_TIMEOUT:g})")


def from_args(args: argparse.Namespace, warn: Callable[[str], None]) -> Prometheus | None:
    """The client the flags and environment describe; None when no URL is given. Raises ValueError."""
    url = args.prometheus or os.environ.get(ENV_URL) or None
    if url is None:
        return None
    username = args.prometheus_username or os.environ.get(f"{ENV_URL}_USERNAME") or None
    password = read_secret(args.prometheus_password_file, "--prometheus-password-file")
    if password is not None and username is None:
        raise ValueError("--prometheus-password-file needs --prometheus-username")
    if username is not None and password is None:
        password = os.environ.get(f"{ENV_URL}_PASSWORD", "")
    endpoint = resolve("prometheus", ENV_URL, url, (username, password) if username else None,
                       read_secret(args.prometheus_bearer_token_file, "--prometheus-bearer-token-file"),
                       args.prometheus_ca_file)
    check_transport(endpoint, "Prometheus", warn, allow_insecure())  # plain http:// beyond loopback: ValueError
    return Prometheus(endpoint, getattr(args, "prometheus_timeout", DEFAULT_TIMEOUT))


class Prometheus:
    """A small client of Prometheus' HTTP API: query, query_range, alerts."""

    def __init__(self, endpoint: Endpoint, timeout: float = DEFAULT_TIMEOUT,
                 max_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._session = session(endpoint)  # one query at a time (a late one may still be reading)

    @property
    def url(self) -> str:
        """The URL as it may be shown (no credentials: they are never part of it)."""
        return shown(self.endpoint.url)

    def __repr__(self) -> str:
        return f"Prometheus({self.url!r})"

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """The matrix `expr` gives over [start, end] every `step` seconds: series of {"metric": {label:
        value}, "values": [(time, value), ...]}, both floats; raises QueryError for anything else."""
        found = self._get("query_range", {"query": expr, "start": start, "end": end, "step": step}, "result")
        try:
            return [{"metric": _labels(series), "values": [(float(t), float(v)) for t, v in series["values"]]}
                    for series in found]
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise QueryError(f"query failed (query_range): malformed series ({type(exc).__name__})") from None

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector `expr` gives now, or at `at`: series of {"metric": {label: value}, "value":
        (time, value)}, the time a float, the value Prometheus' text of a float (for a range selector,
        `expr[5m]`, the matrix: "values": [(time, value), ...]); raises QueryError for anything else."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        found = self._get("query", params, "result")
        try:
            return [{"metric": _labels(series), "values": [_point(point) for point in series["values"]]}
                    if isinstance(series, dict) and "values" in series else
                    {"metric": _labels(series), "value": _point(series["value"])} for series in found]
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise QueryError(f"query failed (query): malformed series ({type(exc).__name__})") from None

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now."""
        return self._get("alerts", {}, "alerts")

    def _get(self, api: str, params: dict[str, Any], key: str) -> list[Any]:
        """`data[key]` of /api/v1/`api`, a list; raises QueryError."""
        url = f"{self.endpoint.url}/api/v1/{api}" + (f"?{urlencode(params)}" if params else "")
        body = self._fetch(api, url)
        try:
            data = json.loads(body)["data"]
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
            raise QueryError(f"query failed ({api}): not a Prometheus answer ({type(exc).__name__})") from None
        found = data.get(key) if isinstance(data, dict) else None
        if not isinstance(found, list):
            raise QueryError(f"query failed ({api}): no list in data.{key}")
        return found

    def _fetch(self, api: str, url: str) -> bytes:
        """The whole body of GET `url` within the timeout; raises QueryError. The request runs in a
        thread: a socket timeout bounds each read, not their sum, nor how long a server trickles."""
        outcome: dict[str, Any] = {}
        late = threading.Event()

        def fetch() -> None:
            try:
                outcome["body"] = self._read(url, late)
            except Exception as exc:  # noqa: BLE001 - handed to the caller, which names it in one line
                outcome["error"] = exc

        worker = threading.Thread(target=fetch, name="dualtrack-prometheus-query", daemon=True)
        worker.start()
        worker.join(self.timeout)
        error = outcome.get("error")
        if worker.is_alive() or isinstance(error, RequestFailed) and isinstance(error.cause, TimeoutError):
            # The socket timeout equals the deadline: whichever fires first, the answer is the same.
            late.set()  # the worker stops at its next read; nobody waits for it
            raise QueryError(f"query failed ({api}): no complete answer within {self.timeout:g} s")
        if isinstance(error, RequestFailed) and error.status == 404:
            raise QueryError(f"query failed ({api}): {mix_up(self.endpoint.url, 'Prometheus')}")
        if isinstance(error, RequestFailed):
            raise QueryError(f"query failed ({api}): {error}")
        if isinstance(error, _TooLarge):
            raise QueryError(f"query failed ({api}): an answer over {self.max_bytes // 2**20} MiB")
        if isinstance(error, (http.client.HTTPException, OSError, ValueError)):
            raise QueryError(f"query failed ({api}): {type(error).__name__}: {str(error)[:200]}")
        if error is not None:
            raise error
        return outcome["body"]

    def _open(self, url: str, timeout: float) -> requests.Response:
        """The 2xx answer to GET `url`, its body not read yet (close it); raises RequestFailed."""
        return send(self._session, "GET", url, timeout, stream=True)

    def _read(self, url: str, late: threading.Event) -> bytes:
        """The body of GET `url`, at most max_bytes; stops early once `late` is set."""
        with self._open(url, self.timeout) as response:
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise _TooLarge()
            chunks: list[bytes] = []
            size = 0
            while not late.is_set():
                try:
                    chunk = response.raw.read(1 << 16)
                except (urllib3.exceptions.HTTPError, OSError, http.client.HTTPException) as exc:
                    raise no_answer(exc, self.timeout) from None
                if not chunk:
                    if declared.isdigit() and size < int(declared):  # urllib3 1.x reads a cut body as whole
                        raise RequestFailed(f"IncompleteRead: {size} bytes read, {int(declared) - size} more expected")
                    return b"".join(chunks)
                size += len(chunk)
                if size > self.max_bytes:
                    raise _TooLarge()
                chunks.append(chunk)
            return b""


def _point(point: Any) -> tuple[float, str]:
    """A (time, value) pair of an answer: the time a float, the value Prometheus' text of a float."""
    return float(point[0]), _number(point[1])


def _number(value: Any) -> str:
    """A sample value as Prometheus writes it ("42", "NaN", "+Inf"); raises ValueError if no float."""
    text = str(value)
    float(text)
    return text


def _labels(series: dict[str, Any]) -> dict[str, str]:
    """A series' labels as text."""
    return {str(k): str(v) for k, v in series["metric"].items()}
