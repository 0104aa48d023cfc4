"""The processes on the simulated GPUs: their memory, their utilization samples, MPS.

Each GPU runs one process, the simulator's own PID (`pid`), unless a `processes` file
(`--simulate.processes`) names the processes each GPU runs: a demo's real training processes, so that
the per-process series join their runs as on a real host. A line "GPU PID" names a process by the same
PID in every PID namespace; "GPU NAMESPACE:PID NAMESPACE:PID ..." by its PID in each namespace that sees
it (the namespace's inode), and the simulator translates it as the driver does (open-gpu-kernel-modules:
os_find_ns_pid): a caller in one of those namespaces gets the PID there, one in any other namespace does
not see the process. The co-tenant scenario adds a process of its own.
"""
from __future__ import annotations

import ctypes
import math
import os
from typing import Any

import pynvml

from exporter.simulated.driver import Driver, nvml_function
from exporter.simulated.nvml_h import H
from exporter.simulated.workload import CO_TENANT_BYTES, CO_TENANT_PID, CO_TENANT_SM, MIB

PROCESS_SAMPLE_PERIOD = 1.0  # seconds between one process's utilization samples while it computes
PROCESS_BUFFER = 16  # samples the driver keeps per process
PROCESS_ENTRIES = 100  # entries a per-process answer has whatever the processes (go-nvml#11): the unused ones empty
NO_INSTANCE = 0xFFFFFFFF  # a process's GPU / compute instance id outside MIG


def _own_pid_namespace() -> str:
    """The inode of this process's PID namespace (decimal), "" where /proc does not say."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _answer(struct_type: Any, entries: list[dict[str, int]], length: int) -> list[Any]:
    """An array of `length` structs, `entries` first and the rest empty, as the binding answers it (a
    slice of the ctypes array the driver filled). Members are set through ctypes' own setattr:
    pynvml's structs override it in Python (to encode str), a cost the driver's C does not have."""
    array = (struct_type * length)()
    store = ctypes.Structure.__setattr__
    for entry, members in zip(array, entries):
        for name, value in members.items():
            store(entry, name, value)
    return list(array[:])


class Processes(Driver):
    """NVML's process functions."""

    def __init__(self, *args: Any, processes: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # a file of "GPU PID" or "GPU NAMESPACE:PID ..." lines: the processes each GPU runs, instead of `pid`
        self.processes = processes
        self.pid = os.getpid()
        self.pid_namespace = _own_pid_namespace()  # the caller's: the one the driver translates PIDs into

    def pids_on(self, gpu: int) -> list[int]:
        """The PIDs GPU `gpu` runs, in the caller's PID namespace: those the `processes` file lists for
        it (read at each call, so a demo can name its runs once they started; lines that are neither
        "GPU PID" nor "GPU NAMESPACE:PID ..." are skipped; a process the caller's namespace does not
        see is left out), else `pid`."""
        if self.processes is None:
            return [self.pid]
        try:
            with open(self.processes, encoding="utf-8", errors="replace") as listing:
                lines = listing.read().splitlines()
        except OSError:
            return []
        found = []
        for gpu_field, *names in (line.split() for line in lines if line.strip()):
            if gpu_field != str(gpu) or not names:
                continue
            if len(names) == 1 and names[0].isdigit():
                found.append(int(names[0]))
                continue
            by_namespace = dict(name.partition(":")[::2] for name in names)
            pid = by_namespace.get(self.pid_namespace, "")
            if pid.isdigit():
                found.append(int(pid))
        return found

    def process_sm(self, gpu: int, pids: list[int], t: float) -> dict[int, float]:
        """Each process's SM utilization (0..1) at time t: the co-tenant takes CO_TENANT_SM of the
        workload's, the training processes share the rest."""
        busy = self.workload.utilization(gpu, t)
        shares = {}
        if self.workload.faulty(gpu, t) == "co-tenant":
            shares[CO_TENANT_PID] = CO_TENANT_SM
            busy = max(0.0, busy - CO_TENANT_SM)
        return {pid: busy / len(pids) for pid in pids} | shares

    @nvml_function
    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        """Like the driver: each computing process's samples newer than `timeStamp` (CPU microseconds),
        none while it idles, grouped by process newest first, padded with empty entries; when there is none,
        what pynvml raises for the driver's SUCCESS without samples, NVMLError(0); NOT_SUPPORTED in MIG mode
        and on boards without it."""
        gpu = self._gpu(handle)
        if self.traits[gpu].mig or not self.traits[gpu].process_utilization:
            raise pynvml.NVMLError_NotSupported()
        now, now_tick = int(self.clock() * 1e6), math.floor(self._t() / PROCESS_SAMPLE_PERIOD)
        pids = self.pids_on(gpu)
        ticks = range(now_tick + 1, max(now_tick - PROCESS_BUFFER, 0), -1)
        loads = {tick: self.process_sm(gpu, pids, (tick - 0.5) * PROCESS_SAMPLE_PERIOD) for tick in ticks}
        samples = []
        for pid in dict.fromkeys([*pids, CO_TENANT_PID]):
            for tick, load in loads.items():
                stamp = self._sample_stamp(pid, tick, PROCESS_SAMPLE_PERIOD)
                if timeStamp < stamp <= now and load.get(pid, 0.0) > 0:
                    samples.append({"pid": pid, "timeStamp": stamp, "smUtil": round(100 * load[pid]),
                                    "memUtil": round(45 * load[pid])})
        if not samples:  # the driver's size query succeeds with nothing to size: pynvml raises NVMLError(SUCCESS)
            raise pynvml.NVMLError(H.NVML_SUCCESS)
        return _answer(pynvml.c_nvmlProcessUtilizationSample_t, samples, PROCESS_ENTRIES)

    @nvml_function
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        """The processes computing on the GPU; under MPS, the MPS server alone (as drivers have answered
        for its clients)."""
        gpu = self._gpu(handle)
        self._check_privilege(gpu, handle)
        server = self.traits[gpu].mps_server
        if server:
            return [self._process(server, 256 * MIB)]
        return self._processes(gpu)

    @nvml_function
    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        """The MPS clients: the listed processes of a GPU with an MPS server, none elsewhere."""
        gpu = self._gpu(handle)
        self._check_privilege(gpu, handle)
        return self._processes(gpu) if self.traits[gpu].mps_server else []

    @staticmethod
    def _process(pid: int, memory: int) -> Any:
        """A process info as the binding answers it."""
        return pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_t(
            pid=pid, usedGpuMemory=memory, gpuInstanceId=NO_INSTANCE, computeInstanceId=NO_INSTANCE))

    def _processes(self, gpu: int) -> list[Any]:
        """The processes GPU `gpu` runs (and the co-tenant), with their memory, as the driver lists them."""
        t = self._t()
        co_tenant = CO_TENANT_BYTES if self.workload.faulty(gpu, t) == "co-tenant" else 0
        pids = self.pids_on(gpu)
        each = (self.workload.memory_used(gpu, t) - 256 * MIB - co_tenant) // len(pids) if pids else 0
        listed = [self._process(pid, each) for pid in pids]
        return [*listed, self._process(CO_TENANT_PID, co_tenant)] if co_tenant else listed
