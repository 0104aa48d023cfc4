"""Constructor arguments and environment resolved into validated settings."""
from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ._torch import torch

ENV_PUSHGATEWAY = "DUALTRACK_PUSHGATEWAY"
ENV_JOB = "DUALTRACK_JOB"
ENV_RUN = "DUALTRACK_RUN"
ENV_GPU_UUID = "DUALTRACK_GPU_UUID"
ENV_USERNAME = "DUALTRACK_PUSHGATEWAY_USERNAME"
ENV_PASSWORD = "DUALTRACK_PUSHGATEWAY_PASSWORD"
ENV_TOKEN = "DUALTRACK_PUSHGATEWAY_TOKEN"
ENV_CA_FILE = "DUALTRACK_PUSHGATEWAY_CA_FILE"
ENV_DELETE_AFTER = "DUALTRACK_DELETE_AFTER"
DEFAULT_DELETE_AFTER = 30.0
DEFAULT_RECORD_DIR = "dualtrack-records"


@dataclass(frozen=True)
class Settings:
    """Everything the monitor needs, checked once at construction."""

    job: str
    run: str
    rank: int
    local_rank: int
    instance: str
    pushgateway: str | None
    push_interval: float
    push_timeout: float
    listen_port: int | None
    listen_address: str
    record_path: Path | None
    gpu_uuids: tuple[str, ...]
    basic_auth: tuple[str, str] | None
    bearer_token: str | None
    ca_file: str | None
    tls_verify: bool
    client_cert: tuple[str, str] | None
    strict: bool
    max_hold: float
    delete_after: float | None

    @property
    def grouping_key(self) -> dict[str, str]:
        """The Pushgateway group, besides `job`."""
        return {"run": self.run, "rank": str(self.rank), "instance": self.instance}


def _positive(name: str, value: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return number


def _pushgateway_url(value: str | bool | None) -> str | None:
    if value is False:
        return None
    if value is None or value is True:
        value = os.environ.get(ENV_PUSHGATEWAY) or None
        if value is None:
            return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"pushgateway must be a URL like http://host:9091, got {value!r}")
    url = value.strip()
    if "://" not in url:
        url = "http://" + url
    parsed = urlparse(url)
    try:
        parsed.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise ValueError(f"pushgateway URL {value!r} has an invalid port") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"pushgateway must be an http(s) URL like http://host:9091, got {value!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"pushgateway URL {value!r} must not have a query or fragment")
    return url.rstrip("/")


def _name(what: str, value: str | None, env: str, default: str | None = None) -> str:
    value = value if value is not None else os.environ.get(env, default)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string (argument or ${env}), got {value!r}")
    return value.strip()


def _rank(rank: int | None) -> tuple[int, int]:
    """(rank, local_rank) from the argument, torchrun's environment or torch.distributed."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        return rank, local_rank
    if os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"]), local_rank
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), local_rank
    return 0, local_rank


def _record_path(value: str | os.PathLike | bool | None, job: str, run: str, rank: int) -> Path | None:
    if value is False:
        return None
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{job}-{run}-rank{rank}")
    if value is None or value is True:
        return Path(DEFAULT_RECORD_DIR) / f"{stem}.jsonl"
    path = Path(value)
    return path / f"{stem}.jsonl" if path.is_dir() else path


def _gpu_uuids(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        value = os.environ.get(ENV_GPU_UUID) or ()
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    uuids = tuple(str(part).strip() for part in value)
    for uuid in uuids:
        if not uuid or any(ch.isspace() for ch in uuid):
            raise ValueError(f"gpu_uuid must look like GPU-xxxxxxxx-..., got {uuid!r}")
    return uuids


def resolve(*, job, run, pushgateway, push_interval, push_timeout, rank, instance, listen_port,
            listen_address, record_path, gpu_uuid, basic_auth, bearer_token, ca_file, tls_verify,
            client_cert, strict, max_hold, delete_after=DEFAULT_DELETE_AFTER) -> Settings:
    """Validate the constructor arguments (falling back to the environment); raise ValueError."""
    job = _name("job", job, ENV_JOB)
    run = _name("run", run, ENV_RUN, default=time.strftime("%Y%m%d-%H%M%S"))
    rank, local_rank = _rank(rank)
    instance = _name("instance", instance, "DUALTRACK_INSTANCE", default=socket.gethostname())
    if listen_port is not None and (isinstance(listen_port, bool) or not isinstance(listen_port, int)
                                    or not 0 <= listen_port <= 65535):
        raise ValueError(f"listen_port must be a TCP port number, got {listen_port!r}")
    if basic_auth is None and os.environ.get(ENV_USERNAME):
        basic_auth = (os.environ[ENV_USERNAME], os.environ.get(ENV_PASSWORD, ""))
    if basic_auth is not None and (len(basic_auth) != 2 or not all(isinstance(p, str) for p in basic_auth)):
        raise ValueError("basic_auth must be a (username, password) pair of strings")
    bearer_token = bearer_token if bearer_token is not None else os.environ.get(ENV_TOKEN) or None
    if basic_auth and bearer_token:
        raise ValueError("give either basic_auth or bearer_token, not both")
    ca_file = ca_file if ca_file is not None else os.environ.get(ENV_CA_FILE) or None
    if ca_file is not None and not Path(ca_file).is_file():
        raise ValueError(f"ca_file {ca_file!r} does not exist")
    if client_cert is not None and (len(client_cert) != 2
                                    or not all(Path(p).is_file() for p in client_cert)):
        raise ValueError("client_cert must be a (certfile, keyfile) pair of existing files")
    return Settings(
        job=job, run=run, rank=rank, local_rank=local_rank, instance=instance,
        pushgateway=_pushgateway_url(pushgateway),
        push_interval=_positive("push_interval", push_interval),
        push_timeout=_positive("push_timeout", push_timeout),
        listen_port=listen_port, listen_address=listen_address,
        record_path=_record_path(record_path, job, run, rank),
        gpu_uuids=_gpu_uuids(gpu_uuid),
        basic_auth=tuple(basic_auth) if basic_auth else None, bearer_token=bearer_token,
        ca_file=ca_file, tls_verify=bool(tls_verify),
        client_cert=tuple(client_cert) if client_cert else None, strict=bool(strict),
        max_hold=0.0 if max_hold == 0 else _positive("max_hold", max_hold),
        delete_after=_delete_after(delete_after),
    )


def _delete_after(value: float | None) -> float | None:
    """Seconds a finished run's group stays on the Pushgateway; None keeps it.

    $DUALTRACK_DELETE_AFTER (seconds, or "none") replaces the default, not an explicit other value.
    """
    what = "delete_after"
    env = os.environ.get(ENV_DELETE_AFTER, "").strip()
    if value == DEFAULT_DELETE_AFTER and env:
        if env.lower() == "none":
            return None
        value, what = env, f"${ENV_DELETE_AFTER}"
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not 0 <= seconds < float("inf"):
        raise ValueError(f"{what} must be a number of seconds >= 0 or None, got {value!r}")
    return seconds
