"""Reading Prometheus' HTTP API for the `dualtrack` commands, with the hook's TLS and auth rules.

Flags (each with an environment fallback, like the hook's DUALTRACK_PUSHGATEWAY_* settings):

    --prometheus URL                     $DUALTRACK_PROMETHEUS
    --prometheus-username USER           $DUALTRACK_PROMETHEUS_USERNAME
    --prometheus-password-file FILE      $DUALTRACK_PROMETHEUS_PASSWORD (the password itself)
    --prometheus-bearer-token-file FILE  $DUALTRACK_PROMETHEUS_TOKEN (the token itself)
    --prometheus-ca-file FILE            $DUALTRACK_PROMETHEUS_CA_FILE

Passwords and tokens never go on the command line (other users see it in `ps`), and never into a
message, a report or repr(): dualtrack.connection checks the URL and credentials.
"""
from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlencode

from .connection import Endpoint, opener, read_secret, resolve, shown, warn_plaintext

ENV_URL = "DUALTRACK_PROMETHEUS"


def quote(value: str) -> str:
    """A PromQL string literal (double-quoted, escaped) for a label value."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class QueryError(Exception):
    """Prometheus could not be asked or answered nonsense (one line, no credentials)."""


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


def from_args(args: argparse.Namespace, warn: Callable[[str], None]) -> "Prometheus | None":
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
    warn_plaintext(endpoint, "Prometheus", warn)
    return Prometheus(endpoint)


class Prometheus:
    """A small client of Prometheus' HTTP API: query, query_range, alerts."""

    def __init__(self, endpoint: Endpoint, timeout: float = 10.0) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._open = opener(endpoint)

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
            return [{"metric": {str(k): str(v) for k, v in series["metric"].items()},
                     "values": [(float(t), float(v)) for t, v in series["values"]]} for series in found]
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise QueryError(f"query failed (query_range): malformed series ({type(exc).__name__})") from None

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector (or scalar/string result list) `expr` gives now, or at `at`."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        return self._get("query", params, "result")

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now."""
        return self._get("alerts", {}, "alerts")

    def _get(self, api: str, params: dict[str, Any], key: str) -> list[Any]:
        """`data[key]` of /api/v1/`api`, a list; raises QueryError."""
        url = f"{self.endpoint.url}/api/v1/{api}" + (f"?{urlencode(params)}" if params else "")
        try:
            with self._open(urllib.request.Request(url), self.timeout) as response:
                data = json.loads(response.read())["data"]
        except urllib.error.HTTPError as exc:
            raise QueryError(f"query failed ({api}): HTTP {exc.code} {str(exc.reason)[:200]}") from None
        except urllib.error.URLError as exc:
            raise QueryError(f"query failed ({api}): {str(exc.reason)[:200]}") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise QueryError(f"query failed ({api}, {type(exc).__name__}: {str(exc)[:200]})") from None
        found = data.get(key) if isinstance(data, dict) else None
        if not isinstance(found, list):
            raise QueryError(f"query failed ({api}): no list in data.{key}")
        return found
