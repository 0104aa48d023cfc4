"""Per-process device memory, with the process's container, Kubernetes pod and Slurm job.

nvidia-smi: --query-compute-apps=pid,process_name,used_memory. NVML:
nvmlDeviceGetComputeRunningProcesses. Names come from /proc/<pid>/comm, attribution from
/proc/<pid>/cgroup (and SLURM_JOB_ID in /proc/<pid>/environ when readable). The driver translates
its PIDs into the caller's PID namespace and leaves out the processes that namespace cannot see
(open-gpu-kernel-modules: os_find_ns_pid), so /proc/<pid> is always the process NVML means: with the
host PID namespace every process, without it only those of the exporter's own.

A process in a container reports its PID in its own PID namespace. The series carry that PID (the
last NSpid field of /proc/<pid>/status, `namespace_pid`) and its start time (field 22 of
/proc/<pid>/stat, clock ticks since boot, `start_time`): both files are readable by every user, and
the pair is what the hook's training_process_info reports as `pid` and `start_time`, a join that needs
no privilege. The inode of the process's PID namespace (`pid_namespace`, from /proc/<pid>/ns/pid)
needs ptrace rights and is extra evidence where readable. Text from /proc is not trusted to be UTF-8
(any user can name a process with any bytes): undecodable bytes are replaced. Process names and PIDs
can be sensitive: `--no-collector.processes` turns all of this off.

Under MPS, the list may hold the MPS server (`nvidia-cuda-mps-server`, comm `nvidia-cuda-mps`) in its
clients' stead; nvmlDeviceGetMPSComputeRunningProcesses lists the clients, and both lists are merged
(a PID in both once). The server is no run's process and no co-tenant (rules/explain.yml).

Each listed process's SM utilization comes from nvmlDeviceGetProcessUtilization (nvidia-smi pmon's
"sm" column). It is a snapshot, not a mean over the exporter's period: nvml.h answers "one utilization
sample structure ... per process running, that had some non-zero utilization during the last sample
period" (the driver's period, 1/6 s to 1 s), newer than the timestamp passed (CPU time in microseconds,
the newest seen). So the gauge is each process's SM share over the driver's last sampling period before
the read, once per `period`; a process busy between two reads but idle in that last period reads 0, and
the GPU-wide nvml_gpu_busy_seconds_total is what integrates time. Where the driver answers more than one
entry for a process, the gauge is their mean. A listed process without an entry (NOT_FOUND, or SUCCESS
with no entries, which pynvml raises as NVMLError(0)) computed nothing: 0, and no error. The driver pads
its answer with empty entries (pid 0, timestamp 0), skipped. GPUs or drivers without it (NOT_SUPPORTED,
some boards and MIG) export no utilization series; that is asked again every few minutes.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import Absent, CallFailed, read_field

log = logging.getLogger(__name__)

UTILIZATION_ABSENT = ("process_utilization",)  # the device's absence key for nvmlDeviceGetProcessUtilization

_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER = re.compile(r"(?:^|[/-])([0-9a-f]{64})(?:\.scope)?$")
_SLURM_JOB = re.compile(r"/job_(\d+)(?:/|$)")
# /proc/self/ns/pid in the initial (host) PID namespace: its inode is PROC_PID_INIT_INO (0xEFFFFFFC)
HOST_PID_NAMESPACE = "pid:[4026531836]"
_NAMESPACE = re.compile(r"pid:\[(\d+)\]")


def in_host_pid_namespace(proc_root: str | Path) -> bool | None:
    """Whether this process sees host PIDs (the ones NVML answers); None when /proc does not say."""
    try:
        return os.readlink(Path(proc_root) / "self" / "ns" / "pid") == HOST_PID_NAMESPACE
    except OSError:
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    name: str = ""
    container_id: str = ""
    pod_uid: str = ""
    slurm_job_id: str = ""
    pid_namespace: str = ""  # the inode of its PID namespace, decimal
    namespace_pid: str = ""  # its PID in its own (innermost) PID namespace
    start_time: str = ""  # when it started: clock ticks since boot (/proc/<pid>/stat field 22)


def _text(path: Path) -> str:
    """A /proc file as text, bytes that are not UTF-8 replaced; "" when it cannot be read."""
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:
        return ""


def pid_namespace(pid_link: Path) -> str:
    """The inode of the PID namespace a /proc/<pid>/ns/pid link names, decimal; "" if unreadable."""
    try:
        match = _NAMESPACE.fullmatch(os.readlink(pid_link))
    except OSError:
        return ""
    return match.group(1) if match else ""


def nspid(status: str) -> list[str]:
    """The NSpid fields of /proc/<pid>/status: its PID in our /proc's namespace, ..., in its own."""
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            fields = line.split()[1:]
            return fields if all(field.isdigit() for field in fields) else []
    return []


def start_time(stat: str) -> str:
    """Field 22 of a /proc/<pid>/stat (starttime: clock ticks since boot, the same in every PID
    namespace); "" if it cannot be read. The name (field 2) may hold spaces and parentheses."""
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 and fields[19].isdigit() else ""


def identify(pid: int, proc_root: Path, own_namespace: str = "") -> ProcessIdentity:
    """Name, innermost PID, start time, PID namespace and workload attribution of a PID NVML
    answered; "" for what cannot be read.

    NSpid and the start time are readable by every user. Reading another user's ns/pid link takes
    ptrace rights (the same uid and no capability we lack, or CAP_SYS_PTRACE); where it is refused, a
    process with one NSpid field is in our /proc's namespace, `own_namespace`."""
    base = proc_root / str(pid)
    name = _text(base / "comm").strip()
    pids = nspid(_text(base / "status"))
    started = start_time(_text(base / "stat"))
    namespace = pid_namespace(base / "ns" / "pid") or (own_namespace if len(pids) == 1 else "")
    inner = pids[-1] if pids and (started or namespace) else ""
    container = pod = job = ""
    cgroup_paths = [line.split(":", 2)[-1] for line in _text(base / "cgroup").splitlines()]
    for path in cgroup_paths:
        pod = pod or _pod(path)
        slurm = _SLURM_JOB.search(path)
        job = job or (slurm.group(1) if slurm else "")
        for part in path.split("/"):
            match = _CONTAINER.search(part)
            container = container or (match.group(1) if match else "")
    if not job:
        job = _environ(base).get("SLURM_JOB_ID", "")
    return ProcessIdentity(name, container, pod, job, namespace, inner, started)


def _pod(path: str) -> str:
    match = _POD.search(path)
    return match.group(1).replace("_", "-") if match else ""


def _environ(base: Path) -> dict[str, str]:
    try:
        raw = (base / "environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


class ProcessesCollector(Collector):
    name = "processes"
    period = 5
    help = "per-process device memory with container/pod/Slurm attribution"

    def __init__(self, device, *, proc_root: str | Path = "/proc", **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.proc_root = Path(proc_root)
        self.own_namespace = pid_namespace(self.proc_root / "self" / "ns" / "pid")
        self.known: dict[int, ProcessIdentity] = {}
        self.mig_hidden = False
        self.last_timestamp = 0  # NVML microseconds of the newest per-process sample seen (0: all kept)

    def collect(self, ctx: SampleContext) -> None:
        processes = self._list(ctx, "nvmlDeviceGetComputeRunningProcesses")
        if processes is None:
            return
        # MPS: the clients, where the driver lists them apart (the list above may hold only the server)
        listed = {int(process.pid): process for process in processes}
        for process in self._list(ctx, "nvmlDeviceGetMPSComputeRunningProcesses") or ():
            listed.setdefault(int(process.pid), process)
        seen: dict[int, ProcessIdentity] = {}
        for pid, process in listed.items():
            seen[pid] = self.known.get(pid) or identify(pid, self.proc_root, self.own_namespace)
            ctx.emit("nvml_gpu_process_memory_used_bytes", process.usedGpuMemory, *_labels(pid, seen[pid]))
        self.known = seen  # forget exited processes (a reused PID is looked up afresh)
        utilization = self._sm_utilization(ctx) if seen else None
        if utilization is not None:
            for pid, identity in seen.items():
                ctx.emit("nvml_gpu_process_sm_utilization_ratio", utilization.get(pid, 0.0), *_labels(pid, identity))

    def _list(self, ctx: SampleContext, function: str) -> list | None:
        """A process list; None when the GPU or driver has none (remembered), MIG hides it or it failed
        (counted)."""
        try:
            return self.device.call(function)
        except Absent:
            return None
        except CallFailed as exc:
            if exc.error == "no_permission" and self.device.mig_mode == "enabled":
                # MIG hides a GPU's processes from an exporter without privilege (CAP_SYS_ADMIN; or
                # NVIDIA_MIG_MONITOR_DEVICES=all): not a collector failure
                if not self.mig_hidden:
                    log.info("GPU %d: processes not visible under MIG (no permission)", self.device.index)
                    self.mig_hidden = True
                return None
            ctx.errors.append(exc.error)
            return None

    def _sm_utilization(self, ctx: SampleContext) -> dict[int, float] | None:
        """Each process's mean SM utilization (0..1) over the driver's samples since the last read;
        None when the GPU has none (remembered) or the read failed (counted)."""
        if self.device.remembers_absent(UTILIZATION_ABSENT):
            return None
        try:
            samples = self.device.call("nvmlDeviceGetProcessUtilization", self.last_timestamp)
        except Absent:  # remembered under one key: Device.call would remember it per timestamp
            self.device.found_absent(UTILIZATION_ABSENT)
            return None
        except CallFailed as exc:
            # NOT_FOUND: no sample newer than the timestamp; SUCCESS: none at all (pynvml raises NVMLError(0)
            # when the driver's size query succeeds, which it does when it has no sample to size)
            if exc.error not in ("not_found", "success"):
                ctx.errors.append(exc.error)
                return None
            samples = []
        by_pid: dict[int, list[float]] = {}
        newest = self.last_timestamp
        for sample in samples:
            pid, stamp = read_field(sample, "pid"), read_field(sample, "timeStamp")
            newest = max(newest, stamp)
            if pid and stamp > self.last_timestamp:
                # clamped: drivers have answered more than 100 %
                by_pid.setdefault(int(pid), []).append(min(max(read_field(sample, "smUtil") / 100, 0.0), 1.0))
        self.last_timestamp = newest
        return {pid: sum(values) / len(values) for pid, values in by_pid.items()}


def _labels(pid: int, identity: ProcessIdentity) -> tuple[str, ...]:
    """The per-process series' labels: pid, process, container_id, pod_uid, slurm_job_id, pid_namespace,
    namespace_pid, start_time."""
    return (str(pid), identity.name, identity.container_id, identity.pod_uid, identity.slurm_job_id,
            identity.pid_namespace, identity.namespace_pid, identity.start_time)
