"""Where the hook's sinks and the `dualtrack janitor` find their URL and credentials: the environment
names and their resolution by trainer_hook.connection's one rule, shared by the monitor's settings
and the command (which must not import the monitor's settings)."""
from __future__ import annotations

import os
from typing import Any

from .connection import Endpoint, resolve

ENV_PUSHGATEWAY = "DUALTRACK_PUSHGATEWAY"  # and its _USERNAME, _PASSWORD, _TOKEN(_FILE), _CA_FILE
ENV_REMOTE_WRITE = "DUALTRACK_REMOTE_WRITE"  # _URL, and its own credentials' _USERNAME, _PASSWORD ...


def pushgateway(url: str | bool | None, basic_auth: Any = None, bearer_token: str | None = None,
                ca_file: str | None = None, client_cert: Any = None, tls_verify: bool = True) -> Endpoint:
    """The Pushgateway's URL (None or False: no Pushgateway; None or True: $DUALTRACK_PUSHGATEWAY) and
    credentials: each argument left None falls back to its environment variable (_USERNAME/_PASSWORD,
    _TOKEN(_FILE), _CA_FILE), checked by trainer_hook.connection.resolve. Raises ValueError with one line."""
    if url is False:
        url = None
    elif url is None or url is True:
        url = os.environ.get(ENV_PUSHGATEWAY) or None
    return resolve("pushgateway", ENV_PUSHGATEWAY, url, basic_auth, bearer_token, ca_file, client_cert,
                   tls_verify)


def remote_write(url: str | None, basic_auth: Any = None, bearer_token: str | None = None,
                 ca_file: str | None = None, client_cert: Any = None, tls_verify: bool = True) -> Endpoint | None:
    """The remote-write receiver (argument, else $DUALTRACK_REMOTE_WRITE_URL) and its own credentials:
    the arguments, else $DUALTRACK_REMOTE_WRITE_USERNAME/_PASSWORD, _TOKEN or _TOKEN_FILE, _CA_FILE, by
    trainer_hook.connection's one rule (never the Pushgateway's). None when no URL is given.
    Raises ValueError with one line."""
    url = url or os.environ.get(f"{ENV_REMOTE_WRITE}_URL") or None
    if url is None:
        return None
    return resolve("remote write", ENV_REMOTE_WRITE, url, basic_auth, bearer_token, ca_file, client_cert,
                   tls_verify)
