"""Constructor arguments and environment resolved into validated settings."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .connection import Endpoint, InsecureCredentials, allow_insecure, check_transport
from .contract import PRECISIONS, label_value
from .credentials import pushgateway, remote_write

log = logging.getLogger("trainer_hook")

ENV_JOB = "DUALTRACK_JOB"
ENV_RUN = "DUALTRACK_RUN"
ENV_GPU_UUID = "DUALTRACK_GPU_UUID"
ENV_DELETE_AFTER = "DUALTRACK_DELETE_AFTER"
ENV_LISTEN = "DUALTRACK_LISTEN"  # _PORT, _ADDRESS, _USERNAME/_PASSWORD, _CERT_FILE/_KEY_FILE
DEFAULT_LISTEN_ADDRESS = "127.0.0.1"
DEFAULT_DELETE_AFTER = 30.0
DEFAULT_PUSH_INTERVAL = 5.0
#: How many ranks one Pushgateway as shipped (its consistency check on) carries with at least 99 % of
#: pushes landing within one push interval, measured with bench/bench_pushgateway.py (docs/scaling.md):
#: at the default 5 s, and with the interval stretched to the most it may be, Prometheus' default 15 s
#: scrape interval (pushing less often than Prometheus scrapes would lose resolution).
PUSHGATEWAY_RANKS_AT_DEFAULT = 100
MAX_STRETCHED_PUSH_INTERVAL = 15.0
PUSHGATEWAY_MAX_RANKS = 170
DEFAULT_RECORD_DIR = "dualtrack-records"
#: (rank, local rank, world size) variables per launcher, the innermost launcher first: torchrun
#: started by srun sees both its own and Slurm's, and its own are the ones that describe the process.
LAUNCHERS = (
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
    ("Slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
)


@dataclass(frozen=True)
class Settings:
    """Everything the monitor needs, checked once at construction."""

    job: str
    run: str
    rank: int
    local_rank: int
    world_size: int
    instance: str
    pushgateway: str | None
    push_interval: float
    push_timeout: float
    listen_port: int | None
    listen_address: str
    listen_basic_auth: tuple[str, str] | None = dataclasses.field(repr=False)
    listen_tls: tuple[str, str] | None  # (certificate file, key file)
    record_path: Path | None
    gpu_uuids: tuple[str, ...]
    basic_auth: tuple[str, str] | None = dataclasses.field(repr=False)  # secrets never in repr()
    bearer_token: str | None = dataclasses.field(repr=False)
    ca_file: str | None
    tls_verify: bool
    client_cert: tuple[str, str] | None
    strict: bool
    max_hold: float
    delete_after: float | None
    record_max_bytes: int | None
    remote_write: Endpoint | None  # its own credentials (remote_write_*); its repr() shows no secret
    refused_sinks: tuple[str, ...]  # sinks not sent to: credentials over plain http:// (counted as failures)
    flops_per_token: float | None
    flops_per_sample: float | None
    precision: str | None  # None: detected (trainer_hook/precision.py)

    @property
    def grouping_key(self) -> dict[str, str]:
        """The Pushgateway group, besides `job`."""
        return {"run": self.run, "rank": str(self.rank), "instance": self.instance}


#: TrainingMonitor's arguments that resolve into a Settings field of another name; every other argument
#: (but `config`, the run's labels) is the field of its own name. resolve() holds the constructor to this.
RESOLVED_INTO: dict[str, str] = {
    "gpu_uuid": "gpu_uuids",
    "remote_write_url": "remote_write", "remote_write_basic_auth": "remote_write",
    "remote_write_bearer_token": "remote_write", "remote_write_ca_file": "remote_write",
    "remote_write_client_cert": "remote_write",
    "allow_insecure_credentials": "refused_sinks",
}


def check_arguments(names: set[str]) -> None:
    """TypeError (one line) unless the argument `names` map onto Settings' fields exactly (RESOLVED_INTO)."""
    fields = {field.name for field in dataclasses.fields(Settings)}
    unknown = sorted(name for name in names if RESOLVED_INTO.get(name, name) not in fields)
    missing = sorted(fields - {RESOLVED_INTO.get(name, name) for name in names})
    if unknown or missing:
        raise TypeError(f"TrainingMonitor's arguments and Settings differ: no field for {unknown}, "
                        f"no argument for {missing}")


def _positive(name: str, value: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return number


def _name(what: str, value: str | None, env: str, default: str | None = None) -> str:
    """A job or instance name: a legal label value (cut to MAX_LABEL_LENGTH, as replay cuts it)."""
    value = value if value is not None else os.environ.get(env, default)
    if not isinstance(value, str) or not label_value(value).strip():
        raise ValueError(f"{what} must be a non-empty string (argument or ${env}), got {value!r}")
    return label_value(value).strip()


def _run(run: str | None) -> str:
    """The explicit run id, else one shared by every rank of the launch, as a legal label value."""
    if run is None:
        run = os.environ.get(ENV_RUN) or _launch_id()
    if not isinstance(run, str) or not label_value(run).strip():
        raise ValueError(f"run must be a non-empty string (argument or ${ENV_RUN}), got {run!r}")
    return label_value(run).strip()


def _launch_id() -> str:
    """torchrun's run id, else Slurm's job[.step] id, else the start time and a random suffix."""
    return _launcher_id()[0] or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _launcher_id() -> tuple[str, str]:
    """(torchrun's run id, else Slurm's job[.step] id, else ""; the launcher's restart count, else "")."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":
        return elastic, os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        step = os.environ.get("SLURM_STEP_ID")
        return (f"{job}.{step}" if step else job), os.environ.get("SLURM_RESTART_COUNT", "")
    return "", ""


def launch_id() -> str:
    """This launch's id, the same on every rank of it: the launcher's id (torchrun's run id, Slurm's
    job[.step], the PMIx namespace or Open MPI's job id) with ".restart<n>" after its n-th restart,
    else one made from the time and a random suffix. A run id launched again gets a new one, so that
    its launches are never mixed."""
    launcher, restarts = _launcher_id()
    launcher = launcher or os.environ.get("PMIX_NAMESPACE", "") or os.environ.get("OMPI_MCA_ess_base_jobid", "")
    if not launcher:
        return label_value(f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")
    restarts = restarts.strip()
    return label_value(launcher + (f".restart{restarts}" if restarts.isdigit() and int(restarts) else ""))


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _count(name: str, value: int | None, minimum: int) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _identity(rank: int | None, local_rank: int | None,
              world_size: int | None) -> tuple[int, int, int]:
    """(rank, local rank, world size): arguments, else torch.distributed (when initialised),
    else the innermost launcher's environment (torchrun, Open MPI, PMI, Slurm), else (0, 0, 1).

    Sources that disagree with the one used are named in one warning.
    """
    given = {"rank": _count("rank", rank, 0), "local_rank": _count("local_rank", local_rank, 0),
             "world_size": _count("world_size", world_size, 1)}
    candidates: dict[str, list[tuple[str, int]]] = {field: [] for field in given}
    for field, value in given.items():
        if value is not None:
            candidates[field].append(("argument", value))
    # torch.distributed is initialised only if the training code imported torch: never import it here
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        candidates["rank"].append(("torch.distributed", dist.get_rank()))
        candidates["world_size"].append(("torch.distributed", dist.get_world_size()))
    for _, *names in LAUNCHERS:
        if _env_int(names[0]) is None:
            continue
        for field, name in zip(given, names):
            if (value := _env_int(name)) is not None:
                candidates[field].append((f"${name}", value))
        break  # the innermost launcher only: an outer one describes its own tasks
    chosen = {field: found[0] if found else ("default", {"world_size": 1}.get(field, 0))
              for field, found in candidates.items()}
    conflicts = [f"{field}={value} from {source}"
                 for field, found in candidates.items() for source, value in found[1:]
                 if value != chosen[field][1]]
    rank, local, size = (chosen[field][1] for field in given)
    if rank >= size:  # unknown (default) or contradicted: at least rank + 1 processes exist
        if chosen["world_size"][0] != "default":
            conflicts.append(f"world_size={size} from {chosen['world_size'][0]} is not above the rank")
        size = rank + 1
    if conflicts:
        used = ", ".join(f"{field}={value} from {source}" for field, (source, value) in chosen.items())
        log.warning("trainer_hook: contradictory rank settings; using %s (ignored: %s)",
                    used, "; ".join(conflicts))
    return rank, local, size


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


def _sinks(a: dict[str, Any]) -> None:
    """Resolve the Pushgateway and remote write in `a`, each with its own credentials. A sink (pull mode's
    endpoint included) whose password would cross plain http:// beyond loopback is refused: ValueError
    when strict, else one warning and the sink left out (named in refused_sinks), unless
    allow_insecure_credentials (or its variable) opts in."""
    tls_verify = bool(a["tls_verify"])
    writer = remote_write(a.pop("remote_write_url"), a.pop("remote_write_basic_auth"),
                          a.pop("remote_write_bearer_token"), a.pop("remote_write_ca_file"),
                          a.pop("remote_write_client_cert"), tls_verify)
    gateway = pushgateway(a["pushgateway"], a["basic_auth"], a["bearer_token"], a["ca_file"], a["client_cert"],
                          tls_verify)
    given = [name for name in ("basic_auth", "bearer_token", "ca_file", "client_cert") if a[name] is not None]
    if writer and not gateway.url and given:
        raise ValueError(f"{'=, '.join(given)}= are the Pushgateway's and no Pushgateway is configured: remote "
                         f"write takes its own ({'=, '.join('remote_write_' + name for name in given)}=)")
    allowed, refused = allow_insecure(a.pop("allow_insecure_credentials")), []
    listener = None
    if a["listen_port"] is not None:  # the same rule for the password pull mode asks for
        listener = Endpoint(f"{'https' if a['listen_tls'] else 'http'}://{_host(a['listen_address'])}",
                            a["listen_basic_auth"])
    for what, endpoint in (("Pushgateway", gateway), ("remote-write receiver", writer),
                           ("pull-mode endpoint", listener)):
        try:
            if endpoint is not None:
                check_transport(endpoint, what, log.warning, allowed)
        except InsecureCredentials as exc:
            if a["strict"]:
                raise
            log.warning("trainer_hook: %s; nothing is sent to it (counted in training_push_failures_total), "
                        "training continues", exc)
            refused.append(what)
    a["remote_write"] = None if "remote-write receiver" in refused else writer
    a["listen_port"] = None if "pull-mode endpoint" in refused else a["listen_port"]
    a.update(pushgateway=None if "Pushgateway" in refused else gateway.url, basic_auth=gateway.basic_auth,
             bearer_token=gateway.bearer_token, ca_file=gateway.ca_file, client_cert=gateway.client_cert,
             refused_sinks=tuple(refused))


def resolve(arguments: Mapping[str, Any]) -> Settings:
    """Settings from TrainingMonitor's arguments (by name; None falls back to the environment).

    Arguments that need no checking go through unchanged: a new constructor argument is a new
    Settings field (plus its check here, if any), which check_arguments() enforces. Raises ValueError
    with one clear message.
    """
    check_arguments(set(arguments))
    a = dict(arguments)
    a["job"] = job = _name("job", a["job"], ENV_JOB)
    a["run"] = run = _run(a["run"])
    a["rank"], a["local_rank"], a["world_size"] = _identity(a["rank"], a["local_rank"], a["world_size"])
    a["instance"] = _name("instance", a["instance"], "DUALTRACK_INSTANCE", default=socket.gethostname())
    a["listen_port"], a["listen_address"] = _listen(a["listen_port"], a["listen_address"])
    a["listen_basic_auth"], a["listen_tls"] = _listen_access(a["listen_basic_auth"], a["listen_tls"])
    listen_port = a["listen_port"]
    if listen_port is not None and (isinstance(listen_port, bool) or not isinstance(listen_port, int)
                                    or not 0 <= listen_port <= 65535):
        raise ValueError(f"listen_port must be a TCP port number, got {listen_port!r}")
    _sinks(a)
    if a["push_interval"] is None:  # on the Pushgateway path, stretched for large runs
        a["push_interval"] = pushgateway_interval(a["world_size"]) if a["pushgateway"] else DEFAULT_PUSH_INTERVAL
    a["push_interval"] = _positive("push_interval", a["push_interval"])
    a["push_timeout"] = _positive("push_timeout", a["push_timeout"])
    a["record_path"] = _record_path(a["record_path"], job, run, a["rank"])
    a["gpu_uuids"] = _gpu_uuids(a.pop("gpu_uuid"))
    a["tls_verify"], a["strict"] = bool(a["tls_verify"]), bool(a["strict"])
    a["max_hold"] = 0.0 if a["max_hold"] == 0 else _positive("max_hold", a["max_hold"])
    a["delete_after"] = _delete_after(a["delete_after"])
    a["flops_per_token"] = _flops("flops_per_token", a["flops_per_token"])
    a["flops_per_sample"] = _flops("flops_per_sample", a["flops_per_sample"])
    if a["precision"] is not None and a["precision"] not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (or None: detected), "
                         f"got {a['precision']!r}")
    return Settings(**a)


def pushgateway_interval(world_size: int) -> float:
    """The default push interval for a run of `world_size` ranks: 5 s, stretched past the ranks one
    Pushgateway carries at 5 s (its consistency check costs each push a pass over every group, so the
    load grows with the square of the ranks), up to 15 s."""
    stretched = DEFAULT_PUSH_INTERVAL * (world_size / PUSHGATEWAY_RANKS_AT_DEFAULT) ** 2
    return min(MAX_STRETCHED_PUSH_INTERVAL, max(DEFAULT_PUSH_INTERVAL, stretched))


def _listen(port: int | None, address: str) -> tuple[int | None, str]:
    """Pull mode's port and address: the arguments, else $DUALTRACK_LISTEN_PORT / _ADDRESS (a pod that a
    PodMonitor scrapes sets them in its environment); the address's default is loopback."""
    env_port = os.environ.get(f"{ENV_LISTEN}_PORT", "").strip()
    if port is None and env_port:
        if not env_port.isdigit():
            raise ValueError(f"${ENV_LISTEN}_PORT must be a TCP port number, got {env_port!r}")
        port = int(env_port)
    if address == DEFAULT_LISTEN_ADDRESS:
        address = os.environ.get(f"{ENV_LISTEN}_ADDRESS", "").strip() or address
    return port, address


def _listen_access(basic_auth: Any, tls: Any) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """Pull mode's basic auth (argument, else $DUALTRACK_LISTEN_USERNAME/_PASSWORD) and TLS certificate
    and key files (argument, else $DUALTRACK_LISTEN_CERT_FILE/_KEY_FILE)."""
    env = os.environ
    if basic_auth is None and env.get(f"{ENV_LISTEN}_USERNAME"):
        basic_auth = (env[f"{ENV_LISTEN}_USERNAME"], env.get(f"{ENV_LISTEN}_PASSWORD", ""))
    if basic_auth is not None and (isinstance(basic_auth, str) or len(basic_auth) != 2
                                   or not all(isinstance(part, str) and part for part in basic_auth)):
        raise ValueError("listen_basic_auth must be a (username, password) pair of non-empty strings")
    if tls is None and env.get(f"{ENV_LISTEN}_CERT_FILE"):
        tls = (env[f"{ENV_LISTEN}_CERT_FILE"], env.get(f"{ENV_LISTEN}_KEY_FILE", ""))
    if tls is not None and (isinstance(tls, str) or len(tls) != 2 or not all(Path(p).is_file() for p in tls)):
        raise ValueError("listen_tls must be a (certificate file, key file) pair of existing files")
    credentials = (str(basic_auth[0]), str(basic_auth[1])) if basic_auth else None
    files = (str(tls[0]), str(tls[1])) if tls else None
    return credentials, files


def _host(address: str) -> str:
    """`address` as a URL's host (an IPv6 address in brackets; all addresses for "")."""
    address = address or "0.0.0.0"
    return f"[{address}]" if ":" in address else address


def _as_float(value: Any) -> float:
    """float(value); NaN for anything that is not a number (a bool included)."""
    if isinstance(value, bool):
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _flops(name: str, value: float | None) -> float | None:
    """Model FLOPs per token or per sample: a positive finite number, or None."""
    if value is None:
        return None
    number = _as_float(value)
    if not 0 < number < float("inf"):
        raise ValueError(f"{name} must be a positive number of FLOPs, got {value!r}")
    return number


def _delete_after(value: float | None) -> float | None:
    """Seconds a finished run's group stays on the Pushgateway; None keeps it.

    $DUALTRACK_DELETE_AFTER (seconds, or "none") replaces the default, not an explicit other value.
    """
    what = "delete_after"
    given: object = value
    env = os.environ.get(ENV_DELETE_AFTER, "").strip()
    if value == DEFAULT_DELETE_AFTER and env:
        if env.lower() == "none":
            return None
        given, what = env, f"${ENV_DELETE_AFTER}"
    if given is None:
        return None
    seconds = _as_float(given)
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{what} must be a number of seconds >= 0 or None, got {given!r}")
    return seconds
