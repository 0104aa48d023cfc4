"""Simulated NVML: a pynvml-compatible module object with simulated GPUs (default "H100 80GB HBM3").

Only `--simulate` (and the tests) construct it; the real code path imports `pynvml` and nothing from
here. It speaks pynvml's language exactly: pynvml's own NVMLError subclasses, ctypes structs
(c_nvmlMemory_v2_t, c_nvmlUtilization_t, c_nvmlFieldValue_t, c_nvmlSample_t, c_nvmlEventData_t,
c_nvmlGpmMetricsGet_t, process infos via nvmlStructToFriendlyObject) and constants, all taken from
the installed pynvml. Functions it does not implement look missing, as on an old driver.

Scenarios: healthy, input-bound (2 s busy / 2 s waiting for data), memory-leak (used memory climbing
in steps until full), demo (healthy -> input-bound -> memory-leak, `phase_seconds` each), and three
faults that start FAULT_AFTER seconds in (what `dualtrack explain` names): thermal-throttle (thermal
slowdown, SM clock down), xid (one XID 79) and co-tenant (another process on the GPU, holding
12 GiB and taking 40 % of the SMs). A list of
scenarios gives GPU i the i-th (cycling), so one daemon serves a sweep's healthy, input-bound and
leaking GPUs side by side.

Each GPU runs one process, the simulator's own PID (`pid`), unless a `processes` file
(`--simulate.processes`) names the processes each GPU runs: a demo's or a test's real training
processes, so that the per-process series join their runs as on a real host. A line "GPU PID" names
a process by the same PID in every PID namespace; "GPU NAMESPACE:PID NAMESPACE:PID ..." by its PID in
each namespace that sees it (the namespace's inode), and the simulator translates it as the driver
does (open-gpu-kernel-modules: os_find_ns_pid): a caller in one of those namespaces gets the PID there,
one in any other namespace does not see the process.

An older driver is `driver_lacks` (entry points libnvidia-ml does not have: the binding answers
FUNCTION_NOT_FOUND, or nvidia-ml-py >= 12.560's NVMLLibraryMismatchError for the functions it calls a
versioned entry point for). Utilization samples are 1/6 s apart by default (NVML: 1/6 s to 1 s by
product); a GPU's GPM counters start again from zero when it falls off the bus; a GPM metric can be
answered NaN (`DeviceTraits.gpm_nan_metrics`). A field is answered in the value type a driver picks for
it (`DeviceTraits.field_types`; PCIE_32_BIT: the PCIe byte counters at 32 bits, wrapping within a
second); a Blackwell GPU (`DeviceTraits.nvlink5`) has its NVLink counters in NVLink5's fields only.

Its own CPU is charged to the process that hosts it (the exporter under `--simulate`; nvitop-exporter
too, in bench/): structs it answers in bulk (field batches, per-process samples) are written as the
driver writes them, into the struct's memory, not member by member through pynvml's Python-level
`__setattr__`, a cost no real binding's answer has. A call's latency is `call_cost`, slept.

Faults (failing, hanging or missing calls, lost GPUs, XID events) are a test tool: the tests'
subclass in tests/nvml_faults.py hooks into `_enter`, `_leave`, `_field_error` and `_new_xids`. Here a GPU
that falls off the bus is `fall_off_bus(gpu)`.
"""
from __future__ import annotations

import ctypes
import math
import os
import struct
import threading
import time
import types
import uuid as uuidlib
from collections import Counter
from dataclasses import dataclass, field as dataclass_field
from functools import wraps
from typing import Any, Callable, Sequence

import pynvml

SCENARIOS = ("healthy", "input-bound", "memory-leak", "demo", "thermal-throttle", "xid", "co-tenant")
#: The fault scenarios (thermal-throttle, xid, co-tenant) run healthy this long first (seconds).
FAULT_AFTER = 30.0
THROTTLED_SM_MHZ = 1200
CO_TENANT_PID = 4242
CO_TENANT_BYTES = 12 * (1 << 30)
CO_TENANT_SM = 0.4  # the co-tenant's share of the SMs, taken from the GPU's training processes
GIB = 1 << 30
MIB = 1 << 20
TICK = 0.1  # seconds: the step of the simulated workload's busy-time integral
JITTER = 0.3  # the driver's sample spacing is not regular: each entry is up to +-JITTER/2 periods off its slot
BUFFER = 120  # entries the driver keeps
PROCESS_SAMPLE_PERIOD = 1.0  # seconds between one process's utilization samples while it computes
PROCESS_BUFFER = 16  # samples the driver keeps per process
PROCESS_ENTRIES = 100  # entries a per-process answer has whatever the processes (go-nvml#11): the unused ones empty
_BUS_IDS = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

#: The NVML constants the simulator speaks, with their values from nvml.h: fixed here, so that the
#: simulated driver does not change with the installed nvidia-ml-py (whose NVML_NVLINK_MAX_LINKS, for
#: one, went from 18 to 36). Installed on the simulated module over the binding's own values.
NVML_H: dict[str, int] = {
    "NVML_SUCCESS": 0, "NVML_ERROR_INVALID_ARGUMENT": 2, "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NOT_FOUND": 6, "NVML_ERROR_GPU_IS_LOST": 15, "NVML_ERROR_UNKNOWN": 999,
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_VALUE_TYPE_DOUBLE": 0, "NVML_VALUE_TYPE_UNSIGNED_INT": 1, "NVML_VALUE_TYPE_UNSIGNED_LONG": 2,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3, "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 4,
    "NVML_VALUE_TYPE_SIGNED_INT": 5, "NVML_VALUE_TYPE_UNSIGNED_SHORT": 6,
    "NVML_CLOCK_GRAPHICS": 0, "NVML_CLOCK_SM": 1, "NVML_CLOCK_MEM": 2, "NVML_CLOCK_VIDEO": 3,
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN": 0, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN": 1,
    "NVML_TEMPERATURE_THRESHOLD_MEM_MAX": 2, "NVML_TEMPERATURE_THRESHOLD_GPU_MAX": 3,
    "NVML_GPU_UTILIZATION_SAMPLES": 1, "NVML_PCIE_UTIL_TX_BYTES": 0, "NVML_PCIE_UTIL_RX_BYTES": 1,
    "NVML_NVLINK_MAX_LINKS": 18,
    "NVML_FI_DEV_ECC_SBE_VOL_TOTAL": 3, "NVML_FI_DEV_ECC_DBE_VOL_TOTAL": 4,
    "NVML_FI_DEV_RETIRED_SBE": 29, "NVML_FI_DEV_RETIRED_DBE": 30, "NVML_FI_DEV_RETIRED_PENDING": 31,
    "NVML_FI_DEV_MEMORY_TEMP": 82, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83,
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 94,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": 138, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": 139,
    "NVML_FI_DEV_REMAPPED_COR": 142, "NVML_FI_DEV_REMAPPED_UNC": 143, "NVML_FI_DEV_REMAPPED_PENDING": 144,
    "NVML_FI_DEV_REMAPPED_FAILURE": 145,
    "NVML_FI_DEV_POWER_AVERAGE": 185, "NVML_FI_DEV_POWER_INSTANT": 186, "NVML_FI_DEV_POWER_CURRENT_LIMIT": 190,
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 197, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 198,
    "NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES": 202, "NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES": 204,
    "NVML_GPM_METRIC_SM_UTIL": 2, "NVML_GPM_METRIC_ANY_TENSOR_UTIL": 5, "NVML_GPM_METRIC_DRAM_BW_UTIL": 10,
    "NVML_GPM_METRIC_PCIE_TX_PER_SEC": 20, "NVML_GPM_METRIC_PCIE_RX_PER_SEC": 21,
    "NVML_GPM_SUPPORT_VERSION": 1, "NVML_GPM_METRICS_GET_VERSION": 1,
    "nvmlEventTypeXidCriticalError": 0x8, "nvmlClocksEventReasonGpuIdle": 0x1,
    "nvmlClocksEventReasonSwThermalSlowdown": 0x20,
}
H = types.SimpleNamespace(**NVML_H)
NVLINK_SCOPE_ALL = 0xFFFFFFFF  # nvml.h: a field's scope id for "summed up across all links"
# nvidia-smi -q -d TEMPERATURE of an H100 SXM: shutdown, slowdown, GPU and memory max operating
_H100_THRESHOLDS = {H.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: 92, H.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 89,
                    H.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: 87, H.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: 95}
MIG_SLOTS = 7  # nvmlDeviceGetMaxMigDeviceCount of an H100
MIG_INSTANCES = 2  # a simulated GPU in MIG mode is split into two GPU instances (ids 1 and 2)
GPM_MIN_WINDOW = 0.1  # seconds: two GPM samples closer than this give no metrics (INVALID_ARGUMENT)
_NVLINK_FIELDS = (H.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, H.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
_NVLINK5_FIELDS = (H.NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES, H.NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES)
#: field_types for a driver that answers the PCIe byte counters at 32 bits (they wrap within a second)
PCIE_32_BIT = {H.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: H.NVML_VALUE_TYPE_UNSIGNED_INT,
               H.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: H.NVML_VALUE_TYPE_UNSIGNED_INT}
_POWER_FIELDS = (H.NVML_FI_DEV_POWER_INSTANT, H.NVML_FI_DEV_POWER_CURRENT_LIMIT, H.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION)
#: c_nvmlFieldValue_t up to its value union: fieldId, scopeId, timestamp, latencyUsec, valueType, nvmlReturn
_FIELD_HEAD = struct.Struct("@IIqqII")
#: the fields whose simulated value never changes (the others are computed in SimulatedNVML._field)
_CONSTANT_FIELDS = {H.NVML_FI_DEV_POWER_CURRENT_LIMIT: 700_000, H.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: 0,
                    H.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: 0, H.NVML_FI_DEV_REMAPPED_COR: 0, H.NVML_FI_DEV_REMAPPED_UNC: 0,
                    H.NVML_FI_DEV_REMAPPED_PENDING: 0, H.NVML_FI_DEV_REMAPPED_FAILURE: 0,
                    H.NVML_FI_DEV_PCIE_REPLAY_COUNTER: 0}
#: binding function -> the driver entry point nvidia-ml-py >= 12.560 calls for it, raising
#: NVMLLibraryMismatchError (a plain Exception) where the driver lacks it (R470/R510 have no _v3)
VERSIONED_ENTRY_POINTS = {"nvmlDeviceGetComputeRunningProcesses": "nvmlDeviceGetComputeRunningProcesses_v3"}
# The PCIe byte counters start this close to 2**64 and wrap a few seconds into a run, as any
# counter eventually does.
PCIE_COUNTER_START = 2**64 - 6 * 10**9
PCIE_TX_RATE, PCIE_RX_RATE, PCIE_RX_BUSY_RATE = 0.5e9, 1.5e9, 4e9  # bytes/s: idle, and more received while busy


@dataclass
class DeviceTraits:
    """What one simulated GPU is and supports."""

    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 81559 * MIB
    fans: int = 0  # SXM boards are passively cooled
    power: bool = True
    mig: bool = False
    gpm: bool = True
    nvlinks: int = 18
    nvlink5: bool = False  # Blackwell: NVLink counters in fields COUNT_XMIT/RCV_BYTES, THROUGHPUT_DATA absent
    compute_instances: int = 1  # per GPU instance in MIG mode: each is a MIG device of its own
    sample_period: float = 1 / 6  # seconds between utilization samples, on average (1/6 s to 1 s by product)
    process_utilization: bool = True  # nvmlDeviceGetProcessUtilization (NOT_SUPPORTED on some boards)
    # MPS: the PID of the MPS server (0: no MPS). The compute process list then holds the server alone
    # (as drivers have answered for its clients), nvmlDeviceGetMPSComputeRunningProcesses the clients
    mps_server: int = 0
    # NVML_VALUE_TYPE_* a field is answered in, where not unsigned long long (the driver picks it per
    # field): an unsigned value wraps at its width
    field_types: dict[int, int] = dataclass_field(default_factory=dict)
    # GPM metric ids (NVML_GPM_METRIC_*) the GPU answers NaN for, with NVML_SUCCESS
    gpm_nan_metrics: tuple[int, ...] = ()


#: NVML_VALUE_TYPE_* -> the C type the driver writes into the c_nvmlValue_t union
VALUE_CTYPES: dict[int, Any] = {
    H.NVML_VALUE_TYPE_DOUBLE: ctypes.c_double, H.NVML_VALUE_TYPE_UNSIGNED_INT: ctypes.c_uint,
    H.NVML_VALUE_TYPE_UNSIGNED_LONG: ctypes.c_ulong, H.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: ctypes.c_ulonglong,
    H.NVML_VALUE_TYPE_SIGNED_LONG_LONG: ctypes.c_longlong, H.NVML_VALUE_TYPE_SIGNED_INT: ctypes.c_int,
    H.NVML_VALUE_TYPE_UNSIGNED_SHORT: ctypes.c_ushort,
}
#: NVML_VALUE_TYPE_* -> how the driver writes it into the union: a double as such; an integer as its
#: bits (unsigned layout of its width, so a signed one is two's complement) and the modulus it wraps at
_VALUE_PACKING: dict[int, tuple[struct.Struct, int | None]] = {
    value_type: (struct.Struct("d"), None) if kind is ctypes.c_double else
    (struct.Struct(kind._type_.upper()), 1 << 8 * ctypes.sizeof(kind)) for value_type, kind in VALUE_CTYPES.items()}


def old_field_value_struct() -> type:
    """c_nvmlFieldValue_t as nvidia-ml-py before 12.560 declares it: its value union has no `usVal`."""
    class Value(ctypes.Union):
        _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint), ("ulVal", ctypes.c_ulong),
                    ("ullVal", ctypes.c_ulonglong), ("sllVal", ctypes.c_longlong), ("siVal", ctypes.c_int)]

    class FieldValue(ctypes.Structure):
        _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                    ("latencyUsec", ctypes.c_longlong), ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                    ("value", Value)]
    return FieldValue


def _api(device: bool = True) -> Callable:
    """Mark an NVML function: count it, charge its cost, and let `_enter` refuse it."""
    def decorate(method: Callable) -> Callable:
        @wraps(method)
        def wrapper(self: "SimulatedNVML", *args: Any, **kwargs: Any) -> Any:
            gpu = self._gpu_of(args[0]) if device and args else None
            self._enter(method.__name__, gpu)
            started = time.thread_time()
            try:
                return self._leave(method.__name__, gpu, method(self, *args, **kwargs))
            finally:
                self.cpu_seconds += time.thread_time() - started
        wrapper.simulated_api = True
        return wrapper
    return decorate


def _is_function(name: str, value: Any) -> bool:
    return isinstance(value, types.FunctionType) and name.startswith("nvml")


def _handle(buffer: ctypes.Array, kind: Any) -> Any:
    return ctypes.cast(buffer, kind)


def _own_pid_namespace() -> str:
    """The inode of this process's PID namespace (decimal), "" where /proc does not say."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _answer(struct_type: type, entries: list[dict[str, int]], length: int) -> list:
    """An array of `length` structs, `entries` first and the rest empty, as the binding answers it (a
    slice of the ctypes array the driver filled). Members are set through ctypes' own setattr:
    pynvml's structs override it in Python (to encode str), a cost the driver's C does not have."""
    array = (struct_type * length)()
    store = ctypes.Structure.__setattr__
    for entry, members in zip(array, entries):
        for name, value in members.items():
            store(entry, name, value)
    return array[:]


def simulated_uuid(index: int) -> str:
    """The UUID of simulated GPU `index` (stable, so a demo run can name the GPU it trains on): the UUID
    version 5 of a URL, computed with CPython's own SHA-1 where there is one, because uuid5's hashlib loads
    libcrypto (3.5 MB resident), which the exporter on real GPUs never loads."""
    try:
        from _sha1 import sha1
    except ImportError:
        from hashlib import sha1
    digest = sha1(uuidlib.NAMESPACE_URL.bytes + f"dualtrack-simulated-{index}".encode()).digest()
    return f"GPU-{uuidlib.UUID(bytes=digest[:16], version=5)}"


class SimulatedNVML:
    """A stand-in for the `pynvml` module. Attribute access falls through to pynvml for constants,
    structs and error classes; pynvml functions not simulated here raise AttributeError."""

    def __init__(self, scenario: str | Sequence[str] = "healthy", gpus: int = 2, *, devices: dict[int, DeviceTraits] | None = None,
                 call_cost: float = 0.0, clock: Callable[[], float] = time.time,
                 phase_seconds: float = 300.0, leak_minutes: float = 30.0, pid: int | None = None,
                 processes: str | os.PathLike | None = None, binding_lacks: tuple[str, ...] = (),
                 driver_lacks: tuple[str, ...] = (), privileged: bool = False) -> None:
        self.scenarios = (scenario,) if isinstance(scenario, str) else tuple(scenario)
        unknown = [name for name in self.scenarios if name not in SCENARIOS]
        if unknown or not self.scenarios:
            raise ValueError(f"unknown scenario {', '.join(unknown) or '(none)'}; choose from {', '.join(SCENARIOS)}")
        self.traits = [(devices or {}).get(i, DeviceTraits()) for i in range(gpus)]
        self.call_cost = call_cost
        self.clock = clock
        self.start = clock()
        self.phase_seconds = phase_seconds
        self.leak_minutes = leak_minutes
        self.pid = os.getpid() if pid is None else pid
        # a file of "GPU PID" or "GPU NAMESPACE:PID ..." lines: the processes each GPU runs, instead of `pid`
        self.processes = processes
        self.pid_namespace = _own_pid_namespace()  # the caller's: the one the driver translates PIDs into
        # the caller holds CAP_SYS_ADMIN: a MIG GPU's parent handle answers its memory and processes
        self.privileged = privileged
        self.calls: Counter = Counter()
        self.cpu_seconds = 0.0  # spent simulating (not by the exporter): benchmarks subtract it
        self.calls_by_gpu: Counter = Counter()
        self._lock = threading.Lock()
        self._buffers = [(ctypes.c_char * 8)() for _ in range(gpus)]
        self._handles = [_handle(b, pynvml.c_nvmlDevice_t) for b in self._buffers]
        self._by_address = {ctypes.addressof(b): i for i, b in enumerate(self._buffers)}
        # MIG devices: MIG_INSTANCES GPU instances (ids 1, 2, ...) on each GPU with the `mig` trait, each
        # with `compute_instances` compute instances: one MIG device (handle, MIG-UUID) per compute instance
        self._mig_devices: dict[int, list[Any]] = {}  # GPU -> its MIG device handles, in slot order
        self._mig_by_address: dict[int, tuple[int, int, int]] = {}  # -> (GPU, GPU instance, compute instance)
        for gpu, traits in enumerate(self.traits):
            for instance in range(1, MIG_INSTANCES + 1) if traits.mig else ():
                for compute in range(traits.compute_instances):
                    buffer = (ctypes.c_char * 8)()
                    self._buffers.append(buffer)
                    self._mig_devices.setdefault(gpu, []).append(_handle(buffer, pynvml.c_nvmlDevice_t))
                    self._mig_by_address[ctypes.addressof(buffer)] = (gpu, instance, compute)
        self._uuids = [simulated_uuid(i) for i in range(gpus)]
        self._integral = [(0.0, 0.0)] * gpus  # (t, busy seconds up to t), advanced tick by tick
        self._gpm_samples: dict[int, tuple[int, float, float]] = {}
        # busy seconds at each GPU's last fall off the bus: its GPM counters restart from there
        self._gpm_counter_base: dict[int, float] = {}
        self._keep: list = []  # ctypes buffers handed out (GPM samples, event sets) stay alive
        self._xid_queue: list[tuple[int, int]] = []
        self._xid_scenario_done: set[int] = set()  # GPUs whose "xid" scenario already sent its XID
        # Like the driver: nothing answers before nvmlInit or after nvmlShutdown, and shutdown frees
        # every event set (with its registrations) and GPM sample.
        self.initialized = False
        self._event_sets: dict[int, set[int]] = {}  # event set address -> GPUs registered on it
        self._lost_on_set: set[int] = set()  # event sets a registered GPU fell off the bus from
        self._undefined_sets: set[int] = set()  # event sets left undefined by a failed registration
        self._shut_down = threading.Event()  # wakes event waits at nvmlShutdown
        self._gpm_buffers: set[int] = set()
        # pynvml's constants, structs and errors as instance attributes: lookups as fast as on the module.
        self.__dict__.update({name: value for name, value in vars(pynvml).items()
                              if not name.startswith("_") and not _is_function(name, value)})
        self.__dict__.update(NVML_H)
        # an older driver: these entry points are not in libnvidia-ml (see VERSIONED_ENTRY_POINTS)
        self.driver_lacks = frozenset(driver_lacks)
        # an older nvidia-ml-py: these constants (or functions) are not in the binding at all;
        # "usVal": the binding's value union has no unsigned short member (before 12.560)
        self.binding_lacks = frozenset(binding_lacks)
        if "usVal" in self.binding_lacks:
            self.c_nvmlFieldValue_t = old_field_value_struct()
        for name in self.binding_lacks:
            self.__dict__.pop(name, None)
            if callable(getattr(type(self), name, None)):
                self.__dict__[name] = None  # shadows the method: getattr(lib, name, None) is None

    # --- module emulation -------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("binding_lacks", ()):
            raise AttributeError(f"this nvidia-ml-py has no {name}")
        value = getattr(pynvml, name)
        if _is_function(name, value):
            raise AttributeError(f"simulated NVML has no {name}")
        return value

    def __dir__(self) -> list[str]:
        return sorted((set(dir(pynvml)) | set(super().__dir__())) - self.binding_lacks)

    def _gpu_of(self, handle: Any) -> int | None:
        if isinstance(handle, bytes):  # a UUID, as nvmlDeviceGetHandleByUUID takes it
            uuid = handle.decode()
            return self._uuids.index(uuid) if uuid in self._uuids else None
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (TypeError, ctypes.ArgumentError):
            return None
        gpu = self._by_address.get(address)
        return self._mig_by_address[address][0] if gpu is None and address in self._mig_by_address else gpu

    def _mig_of(self, handle: Any) -> tuple[int, int, int] | None:
        """(parent GPU, GPU instance id, compute instance id) of a MIG device handle; None for a whole GPU."""
        try:
            return self._mig_by_address.get(ctypes.cast(handle, ctypes.c_void_p).value)
        except (TypeError, ctypes.ArgumentError):
            return None

    def _t(self) -> float:
        return self.clock() - self.start

    def _enter(self, function: str, gpu: int | None) -> None:
        with self._lock:
            self.calls[function] += 1
            if gpu is not None:
                self.calls_by_gpu[gpu] += 1
        if not self.initialized and function != "nvmlInit":
            raise pynvml.NVMLError_Uninitialized()
        entry_point = VERSIONED_ENTRY_POINTS.get(function, function)
        if entry_point in self.driver_lacks:
            mismatch = getattr(pynvml, "NVMLLibraryMismatchError", None)  # nvidia-ml-py >= 12.560
            if entry_point != function and mismatch is not None:
                raise mismatch("Unversioned function called and the pyNVML version does not match the NVML "
                               f"lib version. ... use a versioned function such as {function}_v2")
            raise pynvml.NVMLError_FunctionNotFound()
        if self.call_cost:
            time.sleep(self.call_cost)

    def _leave(self, function: str, gpu: int | None, result: Any) -> Any:
        """What an NVML function answers, given what it computed (the same, here)."""
        return result

    def _field_error(self, gpu: int, field_id: int, t: float) -> int | None:
        """The NVML return code of one field of a batch, if it fails (never, here)."""
        return None

    def _new_xids(self, t: float) -> list[tuple[int, int]]:
        """(gpu, xid) events that happen now: one XID 79 per GPU of the "xid" scenario."""
        due = [gpu for gpu in range(len(self.traits)) if gpu not in self._xid_scenario_done
               and self._faulty(gpu, t) == "xid"]
        self._xid_scenario_done.update(due)
        return [(gpu, 79) for gpu in due]

    def fall_off_bus(self, gpu: int | None) -> None:
        """What a GPU that falls off the bus loses: its event registrations; and every event set it was
        registered on answers GPU_IS_LOST to each wait from then on, whatever the other GPUs on it do; and
        its GPM counters start again from zero."""
        if gpu is not None:
            self._gpm_counter_base[gpu] = self.busy_seconds(gpu, self._t())
        with self._lock:
            for address, registered in self._event_sets.items():
                if gpu in registered:
                    registered.discard(gpu)
                    self._lost_on_set.add(address)

    # --- the simulated workload -------------------------------------------------------------------
    def _phase(self, gpu: int, t: float) -> tuple[str, float]:
        scenario = self.scenarios[gpu % len(self.scenarios)]
        if scenario != "demo":
            return scenario, t
        phase = int(t // self.phase_seconds)
        return ("healthy", "input-bound", "memory-leak")[phase % 3], t - phase * self.phase_seconds

    def _faulty(self, gpu: int, t: float) -> str | None:
        """The fault scenario of `gpu` once it has started (FAULT_AFTER seconds in), else None."""
        scenario = self.scenarios[gpu % len(self.scenarios)]
        return scenario if scenario in ("thermal-throttle", "xid", "co-tenant") and t >= FAULT_AFTER else None

    def utilization(self, gpu: int, t: float) -> float:
        """GPU utilization (0..1) of the simulated workload at time t."""
        scenario, local = self._phase(gpu, t)
        if scenario == "input-bound":
            return 1.0 if local % 4.0 < 2.0 else 0.0
        return 0.93 + 0.04 * math.sin(2 * math.pi * t / 60 + gpu)

    def busy_seconds(self, gpu: int, t: float) -> float:
        """Integral of utilization from start to t, advanced in TICK steps."""
        with self._lock:
            done, total = self._integral[gpu]
            if t < done:
                return total - (done - t) * self.utilization(gpu, t)
            while done + TICK <= t:
                total += self.utilization(gpu, done + TICK / 2) * TICK
                done += TICK
            self._integral[gpu] = (done, total)
        return total + (t - done) * self.utilization(gpu, t)

    def memory_used(self, gpu: int, t: float) -> int:
        scenario, local = self._phase(gpu, t)
        total = self.traits[gpu].memory_total
        if scenario != "memory-leak":
            return 61 * GIB + gpu * 256 * MIB + (CO_TENANT_BYTES if self._faulty(gpu, t) == "co-tenant" else 0)
        step_seconds = 30.0
        steps = max(1.0, self.leak_minutes * 60 / step_seconds)
        base = 20 * GIB
        used = base + (total - 512 * MIB - base) * math.floor(local / step_seconds) / steps
        return int(min(used, total - 512 * MIB))

    def power_mw(self, gpu: int, t: float) -> int:
        return int((90 + 560 * self.utilization(gpu, t)) * 1000)

    def energy_mj(self, gpu: int, t: float) -> int:
        return int((90 * t + 560 * self.busy_seconds(gpu, t)) * 1000)

    # --- system ----------------------------------------------------------------------------------
    @_api(device=False)
    def nvmlInit(self) -> None:
        self.initialized = True
        self._shut_down.clear()

    @_api(device=False)
    def nvmlShutdown(self) -> None:
        self.initialized = False
        self._shut_down.set()
        with self._lock:
            self._event_sets.clear()
            self._lost_on_set.clear()
            self._undefined_sets.clear()
            self._gpm_buffers.clear()
            self._gpm_samples.clear()
            self._keep.clear()

    @_api(device=False)
    def nvmlSystemGetDriverVersion(self) -> str:
        return "simulated"

    @_api(device=False)
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 12040

    @_api(device=False)
    def nvmlDeviceGetCount(self) -> int:
        return len(self.traits)

    @_api(device=False)
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self._handles):
            raise pynvml.NVMLError_InvalidArgument()
        return self._handles[index]

    @_api()
    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> Any:
        ctypes.c_char_p(uuid)  # like pynvml: a str here is a TypeError
        gpu = self._gpu_of(uuid)
        if gpu is None:
            raise pynvml.NVMLError_NotFound()
        return self._handles[gpu]

    # --- identity --------------------------------------------------------------------------------
    @_api()
    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self.traits[self._gpu_of(handle)].name

    @_api()
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        return MIG_SLOTS if self.traits[self._gpu_of(handle)].mig else 0

    @_api()
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any:
        gpu = self._gpu_of(handle)
        if not self.traits[gpu].mig or not 0 <= index < MIG_SLOTS:
            raise pynvml.NVMLError_InvalidArgument()
        if index >= len(self._mig_devices[gpu]):
            raise pynvml.NVMLError_NotFound()
        return self._mig_devices[gpu][index]

    @_api()
    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        return self._mig_ids(handle)[0]

    @_api()
    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        return self._mig_ids(handle)[1]

    def _mig_ids(self, handle: Any) -> tuple[int, int]:
        """(GPU instance id, compute instance id) of a MIG device; INVALID_ARGUMENT for a whole GPU."""
        mig = self._mig_of(handle)
        if mig is None:
            raise pynvml.NVMLError_InvalidArgument()
        return mig[1], mig[2]

    @_api()
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        mig = self._mig_of(handle)
        if mig is not None:
            name = f"dualtrack-simulated-{mig[0]}-gi{mig[1]}" + (f"-ci{mig[2]}" if mig[2] else "")
            return f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, name)}"
        return self._uuids[self._gpu_of(handle)]

    @_api()
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        gpu = self._gpu_of(handle)
        bus = _BUS_IDS[gpu % len(_BUS_IDS)] + gpu // len(_BUS_IDS)
        info = pynvml.nvmlPciInfo_t()
        info.busId = f"00000000:{bus:02X}:00.0".encode()
        info.bus = bus
        return info

    @_api()
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        mode = int(self.traits[self._gpu_of(handle)].mig)
        return [mode, mode]

    # --- readings --------------------------------------------------------------------------------
    @_api()
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu_of(handle)
        if self.traits[gpu].mig:
            raise pynvml.NVMLError_NotSupported()
        busy = self.utilization(gpu, self._t())
        return pynvml.c_nvmlUtilization_t(gpu=round(100 * busy), memory=round(45 * busy))

    @_api()
    def nvmlDeviceGetSamples(self, handle: Any, sampling_type: int, timestamp: int) -> tuple[int, list]:
        gpu = self._gpu_of(handle)
        if self.traits[gpu].mig or sampling_type != H.NVML_GPU_UTILIZATION_SAMPLES:
            raise pynvml.NVMLError_NotSupported()
        period = self.traits[gpu].sample_period
        now, now_tick = int(self.clock() * 1e6), math.floor(self._t() / period)
        first = max(now_tick - BUFFER + 1, 1)
        if timestamp:  # entries up to `timestamp` (each up to JITTER/2 periods off its slot) were read before
            first = max(first, math.floor((timestamp / 1e6 - self.start) / period - JITTER))
        samples = []
        for tick in range(first, now_tick + 2):
            stamp = self._sample_stamp(gpu, tick, period)
            busy = self.utilization(gpu, (tick - 0.5) * period)
            # like the driver: no samples while the GPU idles, none from the future
            if timestamp < stamp <= now and busy > 0:
                sample = pynvml.c_nvmlSample_t(timeStamp=stamp)
                sample.sampleValue.uiVal = round(100 * busy)
                samples.append(sample)
        if not samples:
            raise pynvml.NVMLError_NotFound()
        return H.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    def _sample_stamp(self, key: int, tick: int, period: float) -> int:
        """The driver timestamp (microseconds) of buffer entry `tick` (a sample `period`) of a GPU or a
        process (`key`): its slot, jittered (the same on every read)."""
        offset = ((tick * 2654435761 + key * 40503) % 1000 / 1000 - 0.5) * JITTER  # in ticks
        return int((self.start + (tick + offset) * period) * 1e6)

    @_api()
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._gpu_of(handle)
        self._check_privilege(gpu, handle)
        total, used, reserved = self.traits[gpu].memory_total, self.memory_used(gpu, self._t()), 512 * MIB
        if self._mig_of(handle) is not None:  # an equal share of the GPU per GPU instance
            total, used, reserved = total // MIG_INSTANCES, used // MIG_INSTANCES, reserved // MIG_INSTANCES
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, used=used + reserved, free=total - used - reserved)
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved, used=used,
                                        free=total - used - reserved)

    def _check_privilege(self, gpu: int, handle: Any) -> None:
        """NO_PERMISSION for the parent handle of a GPU in MIG mode, unless the caller is privileged
        (nvml.h: memory and process lists there need "appropriate privileges"; the driver checks
        CAP_SYS_ADMIN). A MIG device's own handle answers."""
        if self.traits[gpu].mig and self._mig_of(handle) is None and not self.privileged:
            raise pynvml.NVMLError_NoPermission()

    def _temperature(self, handle: Any, sensor: int) -> int:
        if sensor != H.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError_InvalidArgument()
        gpu = self._gpu_of(handle)
        if self._faulty(gpu, self._t()) == "thermal-throttle":
            return 88 + gpu
        return round(34 + 36 * self.utilization(gpu, self._t())) + gpu

    @_api()
    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int, version: int = 0x100000C) -> int:
        return self._temperature(handle, sensor)

    @_api()
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:  # deprecated for removal in CUDA 14
        return self._temperature(handle, sensor)

    @_api()
    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        celsius = _H100_THRESHOLDS.get(threshold)
        if celsius is None:  # the acoustic limits: boards with fans only
            raise pynvml.NVMLError_NotSupported()
        return celsius

    @_api()
    def nvmlDeviceGetNumFans(self, handle: Any) -> int:
        fans = self.traits[self._gpu_of(handle)].fans
        if not fans:
            raise pynvml.NVMLError_NotSupported()
        return fans

    @_api()
    def nvmlDeviceGetFanSpeed_v2(self, handle: Any, fan: int) -> int:
        gpu = self._gpu_of(handle)
        if fan >= self.traits[gpu].fans:
            raise pynvml.NVMLError_InvalidArgument()
        return round(30 + 40 * self.utilization(gpu, self._t()))

    def _power(self, handle: Any) -> int:
        gpu = self._gpu_of(handle)
        if not self.traits[gpu].power:
            raise pynvml.NVMLError_NotSupported()
        return gpu

    @_api()
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        gpu = self._power(handle)
        return self.power_mw(gpu, self._t())

    @_api()
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        self._power(handle)
        return 700_000

    @_api()
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        gpu = self._power(handle)
        return self.energy_mj(gpu, self._t())

    @_api()
    def nvmlDeviceGetPerformanceState(self, handle: Any) -> int:
        return 0

    @_api()
    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        gpu, t = self._gpu_of(handle), self._t()
        busy = self.utilization(gpu, t) >= 0.05
        top = THROTTLED_SM_MHZ if self._faulty(gpu, t) == "thermal-throttle" else 1980
        return {H.NVML_CLOCK_GRAPHICS: top if busy else 345, H.NVML_CLOCK_SM: top if busy else 345,
                H.NVML_CLOCK_MEM: 2619, H.NVML_CLOCK_VIDEO: 1755 if busy else 765}[clock]

    @_api()
    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock: int) -> int:
        return {H.NVML_CLOCK_GRAPHICS: 1980, H.NVML_CLOCK_SM: 1980, H.NVML_CLOCK_MEM: 2619,
                H.NVML_CLOCK_VIDEO: 1965}[clock]

    def _reasons(self, handle: Any) -> int:
        gpu, t = self._gpu_of(handle), self._t()
        idle = self.utilization(gpu, t) < 0.05
        thermal = self._faulty(gpu, t) == "thermal-throttle"
        return ((H.nvmlClocksEventReasonGpuIdle if idle else 0)
                | (H.nvmlClocksEventReasonSwThermalSlowdown if thermal else 0))

    @_api()
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._reasons(handle)

    @_api()
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:  # the pre-R535 name
        return self._reasons(handle)

    @_api()
    def nvmlDeviceGetPcieThroughput(self, handle: Any, counter: int) -> int:
        busy = self.utilization(self._gpu_of(handle), self._t())
        return int((PCIE_TX_RATE if counter == H.NVML_PCIE_UTIL_TX_BYTES else PCIE_RX_RATE + PCIE_RX_BUSY_RATE * busy)
                   / 1024)

    def pids_on(self, gpu: int) -> list[int]:
        """The PIDs GPU `gpu` runs, in the caller's PID namespace: those the `processes` file lists for
        it (read at each call, so a demo can name its runs once they started; lines that are neither
        "GPU PID" nor "GPU NAMESPACE:PID ..." are skipped; a process the caller's namespace does not
        see is left out), else `pid`."""
        if self.processes is None:
            return [self.pid]
        try:
            lines = open(self.processes, encoding="utf-8", errors="replace").read().splitlines()
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
        busy = self.utilization(gpu, t)
        shares = {}
        if self._faulty(gpu, t) == "co-tenant":
            shares[CO_TENANT_PID] = CO_TENANT_SM
            busy = max(0.0, busy - CO_TENANT_SM)
        return {pid: busy / len(pids) for pid in pids} | shares

    @_api()
    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list:
        """Like the driver: each computing process's samples newer than `timeStamp` (CPU microseconds),
        none while it idles, grouped by process newest first, padded with empty entries; when there is none,
        what pynvml raises for the driver's SUCCESS without samples, NVMLError(0); NOT_SUPPORTED in MIG mode
        and on boards without it."""
        gpu = self._gpu_of(handle)
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

    @_api()
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list:
        gpu = self._gpu_of(handle)
        self._check_privilege(gpu, handle)
        if self.traits[gpu].mps_server:
            return [pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_t(
                pid=self.traits[gpu].mps_server, usedGpuMemory=256 * MIB, gpuInstanceId=0xFFFFFFFF,
                computeInstanceId=0xFFFFFFFF))]
        return self._processes(gpu)

    @_api()
    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list:
        """The MPS clients: the listed processes of a GPU with an MPS server, none elsewhere."""
        gpu = self._gpu_of(handle)
        self._check_privilege(gpu, handle)
        return self._processes(gpu) if self.traits[gpu].mps_server else []

    def _processes(self, gpu: int) -> list:
        """The processes GPU `gpu` runs (and the co-tenant), with their memory, as the driver lists them."""
        t = self._t()
        co_tenant = CO_TENANT_BYTES if self._faulty(gpu, t) == "co-tenant" else 0
        pids = self.pids_on(gpu)
        infos = [pynvml.c_nvmlProcessInfo_t(pid=pid, usedGpuMemory=(self.memory_used(gpu, t) - 256 * MIB - co_tenant) // len(pids),
                                            gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF) for pid in pids]
        if co_tenant:
            infos.append(pynvml.c_nvmlProcessInfo_t(pid=CO_TENANT_PID, usedGpuMemory=co_tenant,
                                                    gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))
        return [pynvml.nvmlStructToFriendlyObject(info) for info in infos]

    @_api()
    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list) -> Any:
        gpu = self._gpu_of(handle)
        t = self._t()
        busy = self.busy_seconds(gpu, t)
        types = self.traits[gpu].field_types
        stamp = int(self.clock() * 1e6)
        # Written into the array's memory as the driver writes it, in C: set member by member through
        # pynvml's structs (whose __setattr__ is Python), this one batch cost the simulation ten other
        # calls' worth of CPU, charged to the process that hosts it.
        struct_type = self.c_nvmlFieldValue_t
        size, value_at = ctypes.sizeof(struct_type), struct_type.value.offset
        memory = bytearray(size * len(field_ids))
        for offset, requested in zip(range(0, len(memory), size), field_ids):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            error = self._field_error(gpu, field_id, t) or self._scope_error(gpu, field_id, scope)
            reading = None if error else self._field(gpu, field_id, scope, t, busy)
            value_type = 0
            if error is None and reading is None:
                error = H.NVML_ERROR_NOT_SUPPORTED
            elif error is None:
                value_type = types.get(field_id, H.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG)
                packing, wraps_at = _VALUE_PACKING[value_type]
                packing.pack_into(memory, offset + value_at, reading if wraps_at is None else int(reading) % wraps_at)
            _FIELD_HEAD.pack_into(memory, offset, field_id, scope, stamp, 0, value_type, error or H.NVML_SUCCESS)
        return (struct_type * len(field_ids)).from_buffer(memory)

    def _scope_error(self, gpu: int, field_id: int, scope: int) -> int | None:
        """INVALID_ARGUMENT for a link id past NVML_NVLINK_MAX_LINKS (other than "all links")."""
        if (field_id in _NVLINK_FIELDS or field_id in _NVLINK5_FIELDS) and scope != NVLINK_SCOPE_ALL \
                and scope >= H.NVML_NVLINK_MAX_LINKS:
            return H.NVML_ERROR_INVALID_ARGUMENT
        return None

    def _field(self, gpu: int, field_id: int, scope: int, t: float, busy: float) -> float | None:
        traits = self.traits[gpu]
        if field_id in _NVLINK_FIELDS or field_id in _NVLINK5_FIELDS:
            # each link carries an equal share of 20 GB per busy second: KiB in the older fields, bytes in NVLink5's
            if (not traits.nvlinks or (scope != NVLINK_SCOPE_ALL and scope >= traits.nvlinks)
                    or traits.nvlink5 != (field_id in _NVLINK5_FIELDS)):
                return None
            unit = 1 if traits.nvlink5 else 1024
            return 20e9 * busy / unit / (1 if scope == NVLINK_SCOPE_ALL else traits.nvlinks)
        if field_id in _POWER_FIELDS and not traits.power:
            return None
        if field_id == H.NVML_FI_DEV_MEMORY_TEMP:
            return 40 + 20 * self.utilization(gpu, t)
        if field_id == H.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            return self.energy_mj(gpu, t)
        if field_id == H.NVML_FI_DEV_POWER_INSTANT:
            return self.power_mw(gpu, t)
        if field_id == H.NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
            return (PCIE_COUNTER_START + int(PCIE_TX_RATE * t)) % 2**64
        if field_id == H.NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
            return (PCIE_COUNTER_START + int(PCIE_RX_RATE * t + PCIE_RX_BUSY_RATE * busy)) % 2**64
        return _CONSTANT_FIELDS.get(field_id)

    # --- events (XID) ----------------------------------------------------------------------------
    def _registered(self, event_set: Any) -> set[int]:
        """The GPUs registered on a live event set; INVALID_ARGUMENT for a freed or unknown one."""
        registered = self._event_sets.get(ctypes.cast(event_set, ctypes.c_void_p).value)
        if registered is None:
            raise pynvml.NVMLError_InvalidArgument()
        return registered

    @_api(device=False)
    def nvmlEventSetCreate(self) -> Any:
        buffer = (ctypes.c_char * 8)()
        self._keep.append(buffer)
        self._event_sets[ctypes.addressof(buffer)] = set()
        return _handle(buffer, pynvml.c_nvmlEventSet_t)

    @_api(device=False)
    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._registered(event_set)
        address = ctypes.cast(event_set, ctypes.c_void_p).value
        del self._event_sets[address]
        self._lost_on_set.discard(address)
        self._undefined_sets.discard(address)

    def undefine_event_set(self, event_set: Any) -> None:
        """A registration on `event_set` failed with UNKNOWN: nvml.h leaves the set undefined (it must be
        freed); here every wait on it answers UNKNOWN and delivers nothing."""
        self._undefined_sets.add(ctypes.cast(event_set, ctypes.c_void_p).value)

    @_api()
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        self._registered(event_set).add(self._gpu_of(handle))

    @_api(device=False)
    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if not self.initialized:  # shut down while waiting
                raise pynvml.NVMLError_Uninitialized()
            registered = self._registered(event_set)
            if ctypes.cast(event_set, ctypes.c_void_p).value in self._undefined_sets:
                raise pynvml.NVMLError_Unknown()
            if ctypes.cast(event_set, ctypes.c_void_p).value in self._lost_on_set:
                raise pynvml.NVMLError_GpuIsLost()
            t = self._t()
            # Draw new events only once the pending ones are delivered: they must not queue faster
            # than the waits consume them.
            if not self._xid_queue:
                self._xid_queue.extend(self._new_xids(t))
            while self._xid_queue and self._xid_queue[0][0] not in registered:
                self._xid_queue.pop(0)  # happened on a GPU not registered on this set: never delivered
            if self._xid_queue:
                gpu, xid, *instance = self._xid_queue.pop(0)  # a MIG XID names its GPU instance
                return pynvml.c_nvmlEventData_t(device=self._handles[gpu],
                                                eventType=H.nvmlEventTypeXidCriticalError, eventData=xid,
                                                gpuInstanceId=instance[0] if instance else 0xFFFFFFFF,
                                                computeInstanceId=0xFFFFFFFF)
            if time.monotonic() >= deadline:
                raise pynvml.NVMLError_Timeout()
            # A driver blocks here. Where no XID can come (no "xid" scenario, no test's faults), only
            # nvmlShutdown ends the wait early: block until then, instead of polling at a CPU cost
            # (0.3 % of a core) that a driver does not have.
            pause = 0.05 if self._xids_possible() else deadline - time.monotonic()
            self._shut_down.wait(min(pause, max(0.0, deadline - time.monotonic())))

    def _xids_possible(self) -> bool:
        """Whether a wait may end early other than by nvmlShutdown: an "xid" scenario, or a subclass (the
        tests' faults: XIDs, GPUs falling off the bus, undefined event sets)."""
        return "xid" in self.scenarios or type(self) is not SimulatedNVML

    # --- GPM -------------------------------------------------------------------------------------
    @_api()
    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = H.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(self.traits[self._gpu_of(handle)].gpm)
        return support

    @_api(device=False)
    def nvmlGpmSampleAlloc(self) -> Any:
        buffer = (ctypes.c_char * 8)()
        self._keep.append(buffer)
        self._gpm_buffers.add(ctypes.addressof(buffer))
        return _handle(buffer, pynvml.c_nvmlGpmSample_t)

    def _gpm_buffer(self, sample: Any) -> int:
        address = ctypes.cast(sample, ctypes.c_void_p).value
        if address not in self._gpm_buffers:
            raise pynvml.NVMLError_InvalidArgument()
        return address

    @_api(device=False)
    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._gpm_buffers.discard(self._gpm_buffer(sample))

    @_api()
    def nvmlGpmMigSampleGet(self, handle: Any, gpu_instance_id: int, sample: Any) -> Any:
        self._gpm_buffer(sample)
        gpu = self._gpu_of(handle)
        if not self.traits[gpu].mig or not 1 <= gpu_instance_id <= MIG_INSTANCES:
            raise pynvml.NVMLError_InvalidArgument()
        self._gpm_sample(gpu, sample)
        return sample

    @_api()
    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> Any:
        self._gpm_buffer(sample)
        gpu = self._gpu_of(handle)
        if self.traits[gpu].mig:  # in MIG mode GPM answers per GPU instance only
            raise pynvml.NVMLError_NotSupported()
        self._gpm_sample(gpu, sample)
        return sample

    def _gpm_sample(self, gpu: int, sample: Any) -> None:
        """Fill `sample` with the GPU's busy counter, which starts again from zero when it falls off the bus."""
        t = self._t()
        counter = self.busy_seconds(gpu, t) - self._gpm_counter_base.get(gpu, 0.0)
        self._gpm_samples[ctypes.cast(sample, ctypes.c_void_p).value] = (gpu, t, counter)

    @_api(device=False)
    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        first = self._gpm_samples[ctypes.cast(request.sample1, ctypes.c_void_p).value]
        second = self._gpm_samples[ctypes.cast(request.sample2, ctypes.c_void_p).value]
        if second[1] - first[1] < GPM_MIN_WINDOW:
            raise pynvml.NVMLError_InvalidArgument()
        busy = (second[2] - first[2]) / (second[1] - first[1])
        scale = {H.NVML_GPM_METRIC_SM_UTIL: 85.0, H.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 60.0,
                 H.NVML_GPM_METRIC_DRAM_BW_UTIL: 45.0}
        pcie = {H.NVML_GPM_METRIC_PCIE_TX_PER_SEC: PCIE_TX_RATE / MIB,  # MiB/s
                H.NVML_GPM_METRIC_PCIE_RX_PER_SEC: (PCIE_RX_RATE + PCIE_RX_BUSY_RATE * busy) / MIB}
        nan = self.traits[second[0]].gpm_nan_metrics
        for slot in range(request.numMetrics):
            metric = request.metrics[slot]
            if metric.metricId in nan:
                metric.value, metric.nvmlReturn = math.nan, H.NVML_SUCCESS
            elif metric.metricId in scale:
                # from counters, as the driver does: across a fall off the bus they restarted, and the
                # difference is garbage (negative here)
                metric.value, metric.nvmlReturn = scale[metric.metricId] * busy, H.NVML_SUCCESS
            elif metric.metricId in pcie:
                metric.value, metric.nvmlReturn = pcie[metric.metricId], H.NVML_SUCCESS
            else:
                metric.nvmlReturn = H.NVML_ERROR_NOT_SUPPORTED
        return request
