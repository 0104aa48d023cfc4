"""The simulated NVML under the tests' control (tests and bench only, not shipped): fault injection
(failing, hanging or missing calls, failing fields, lost GPUs, XID events, from a list of `Fault`s or a
JSON fault plan), a fake clock, the PID of the GPUs' process, a privileged caller, an older driver or
binding, and counts of the calls it answered and of the CPU it spent answering them.

A plan file, as `python -m tests.support.faulty_exporter --faults=FILE` and `FaultyNVML` read it::

    {"devices": {"1": {"fans": 2, "power": false, "mig": true}},
     "faults": [{"gpu": 1, "function": "*", "error": "GpuIsLost", "at": 3, "until": 8},
                {"gpu": 0, "field": 186, "error": "Unknown"},
                {"gpu": 0, "function": "nvmlDeviceGetTemperatureV", "hang": 30, "at": 2, "times": 1},
                {"function": "nvmlDeviceGetSamples", "error": "FunctionNotFound"},
                {"gpu": 0, "xid": 79, "at": 1, "times": 3}]}

`devices` changes what a GPU has (exporter.simulated.DeviceTraits; `"field_types": {"197": 1, "198": 1}`
answers the PCIe byte counters at 32 bits, `"nvlink5": true` NVLink in Blackwell's fields); `at`/`until`
are seconds since start; `times` caps how often a rule fires; `error` is a pynvml error class suffix
(NVMLError_<error>); `hang` sleeps inside the call; `xid` raises XID events. `answer` (bytes, from
Python only) is what the driver writes for a text function (names, versions, UUIDs), or into the
struct field `answer_field` (busId): it goes through pynvml's own decoding, which raises
UnicodeDecodeError on invalid UTF-8 as the real binding does. A registration for events that fails
with "Unknown" leaves its event set undefined, as nvml.h says: waits on it fail. A GPU that falls off
the bus (GpuIsLost on every call) loses its event registrations, every event set it was registered on
answers GPU_IS_LOST to each wait from then on, and its GPM counters start again from zero.

An older driver is `driver_lacks` (entry points libnvidia-ml does not have: the binding answers
FUNCTION_NOT_FOUND, or nvidia-ml-py >= 12.560's NVMLLibraryMismatchError for the functions it calls a
versioned entry point for); an older nvidia-ml-py is `binding_lacks` (constants or functions it does
not have; "usVal": its field value union has no unsigned short member, as before 12.560).
"""
from __future__ import annotations

import ctypes
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from functools import wraps
from typing import Any

import pynvml

from exporter.simulated import DeviceTraits, SimulatedNVML
from exporter.simulated.driver import address

#: binding function -> the driver entry point nvidia-ml-py >= 12.560 calls for it, raising
#: NVMLLibraryMismatchError (a plain Exception) where the driver lacks it (R470/R510 have no _v3)
VERSIONED_ENTRY_POINTS = {"nvmlDeviceGetComputeRunningProcesses": "nvmlDeviceGetComputeRunningProcesses_v3"}


@dataclass
class Fault:
    """One injected misbehaviour; see the module docstring."""

    gpu: int | None = None
    function: str | None = None
    field: int | None = None
    error: str | None = None
    hang: float = 0.0
    xid: int | None = None
    gpu_instance: int | None = None  # the MIG GPU instance an `xid` event names
    answer: bytes | None = None
    answer_field: str | None = None
    at: float = 0.0
    until: float = math.inf
    times: int | None = None
    fired: int = 0

    def active(self, t: float) -> bool:
        return self.at <= t < self.until and (self.times is None or self.fired < self.times)

    def matches_call(self, function: str, gpu: int | None) -> bool:
        if self.field is not None or self.xid is not None:
            return False
        if self.gpu is not None and self.gpu != gpu:
            return False
        return self.function == function or (self.function == "*" and gpu is not None)


class FaultPlanError(ValueError):
    """The fault file is unreadable or malformed (one-line message)."""


def load_fault_plan(path: str) -> tuple[dict[int, DeviceTraits], list[Fault]]:
    """Read a fault plan JSON file; raises FaultPlanError with a one-line message."""
    try:
        with open(path) as handle:
            plan = json.load(handle)
        known = {f.name for f in dataclass_fields(DeviceTraits)}
        devices = {}
        for index, traits in plan.get("devices", {}).items():
            unknown = set(traits) - known
            if unknown:
                raise FaultPlanError(f"{path}: unknown device trait(s) {sorted(unknown)}")
            if "field_types" in traits:  # JSON keys are strings; field ids are numbers
                traits = {**traits, "field_types": {int(field): kind for field, kind in traits["field_types"].items()}}
            devices[int(index)] = DeviceTraits(**traits)
        faults = [Fault(**rule) for rule in plan.get("faults", [])]
    except FaultPlanError:
        raise
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise FaultPlanError(f"cannot use fault plan {path}: {exc}") from exc
    for fault in faults:
        if fault.error and not hasattr(pynvml, f"NVMLError_{fault.error}"):
            raise FaultPlanError(f"{path}: unknown NVML error {fault.error!r}")
    return devices, faults


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


class FaultyNVML(SimulatedNVML):
    """The simulated NVML with `faults` applied to its calls, fields and events, read on `clock`, its GPUs
    running `pid`, its caller `privileged` or not, as an older driver or binding; it counts its calls."""

    def __init__(self, *args: Any, faults: list[Fault] | None = None, clock: Callable[[], float] | None = None,
                 pid: int | None = None, privileged: bool = False, binding_lacks: tuple[str, ...] = (),
                 driver_lacks: tuple[str, ...] = (), **kwargs: Any) -> None:
        self._clock = clock or time.time  # read by SimulatedNVML.__init__
        super().__init__(*args, **kwargs)
        self.faults = list(faults or [])
        self.pid = self.pid if pid is None else pid
        self.privileged = privileged  # holds CAP_SYS_ADMIN: a MIG GPU's parent handle answers
        self.driver_lacks = frozenset(driver_lacks)
        self.binding_lacks = frozenset(binding_lacks)
        if "usVal" in self.binding_lacks:
            self.c_nvmlFieldValue_t = old_field_value_struct()
        for name in self.binding_lacks:
            self.__dict__.pop(name, None)
            if callable(getattr(type(self), name, None)):
                self.__dict__[name] = None  # shadows the method: getattr(lib, name, None) is None
        self.calls: Counter[str] = Counter()
        self.calls_by_gpu: Counter[int] = Counter()
        self.cpu_seconds = 0.0  # spent simulating (not by the exporter): benchmarks subtract it
        self._count_lock = threading.Lock()
        self._gpm_counter_base: dict[int, float] = {}  # busy seconds at each GPU's last fall off the bus

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("binding_lacks", ()):
            raise AttributeError(f"this nvidia-ml-py has no {name}")
        return super().__getattr__(name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) - self.binding_lacks)

    def clock(self) -> float:
        return self._clock()

    def _check_privilege(self, gpu: int, handle: Any) -> None:
        if not self.privileged:
            super()._check_privilege(gpu, handle)

    def _before(self, function: str, gpu: int | None, args: tuple[Any, ...]) -> None:
        """Count the call, then refuse it as an older driver would, or as a fault says."""
        with self._count_lock:
            self.calls[function] += 1
            if gpu is not None:
                self.calls_by_gpu[gpu] += 1
        entry_point = VERSIONED_ENTRY_POINTS.get(function, function)
        if entry_point in self.driver_lacks:
            mismatch = getattr(pynvml, "NVMLLibraryMismatchError", None)  # nvidia-ml-py >= 12.560
            if entry_point != function and mismatch is not None:
                raise mismatch("Unversioned function called and the pyNVML version does not match the NVML "
                               f"lib version. ... use a versioned function such as {function}_v2")
            raise pynvml.NVMLError_FunctionNotFound()
        t = self._t()
        for fault in self.faults:
            if fault.answer is None and fault.active(t) and fault.matches_call(function, gpu):
                fault.fired += 1
                if fault.hang:
                    time.sleep(fault.hang)
                if fault.error == "GpuIsLost" and fault.function == "*":
                    self.fall_off_bus(gpu)
                if fault.error == "Unknown" and function == "nvmlDeviceRegisterEvents":
                    self.undefine_event_set(args[2])
                if fault.error:
                    raise getattr(pynvml, f"NVMLError_{fault.error}")()

    def _after(self, function: str, gpu: int | None, result: Any) -> Any:
        """What the call answers: what the driver wrote, unless a fault writes the answer."""
        t = self._t()
        for fault in self.faults:
            if fault.answer is not None and fault.active(t) and fault.matches_call(function, gpu):
                fault.fired += 1
                if fault.answer_field is None:
                    return pynvml.convertStrBytes(lambda answer=fault.answer: answer)()
                setattr(result, fault.answer_field, fault.answer)  # a pynvml struct: decoded when read
                return result
        return result

    def fall_off_bus(self, gpu: int | None) -> None:
        """What a GPU that falls off the bus loses: its event registrations; and every event set it was
        registered on answers GPU_IS_LOST to each wait from then on, whatever the other GPUs on it do; and
        its GPM counters start again from zero."""
        if gpu is None:
            return
        self._gpm_counter_base[gpu] = self.workload.busy_seconds(gpu, self._t())
        with self._lock:
            for event_set in self._event_sets.values():
                if gpu in event_set.gpus:
                    event_set.gpus.discard(gpu)
                    event_set.error = event_set.error or pynvml.NVMLError_GpuIsLost

    def undefine_event_set(self, handle: Any) -> None:
        """A registration on an event set failed with UNKNOWN: nvml.h leaves the set undefined (it must be
        freed); here every wait on it answers UNKNOWN and delivers nothing."""
        event_set = self._event_sets.get(address(handle) or 0)
        if event_set is not None:
            event_set.error = pynvml.NVMLError_Unknown

    def _gpm_counter(self, gpu: int, t: float) -> float:
        return super()._gpm_counter(gpu, t) - self._gpm_counter_base.get(gpu, 0.0)

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[Any]) -> Any:
        """The driver's batch, with the fields a fault fails answered as failed (no value)."""
        values = super().nvmlDeviceGetFieldValues(handle, field_ids)
        gpu, t = self._gpu_of(handle), self._t()
        for value in values:
            error = None if gpu is None else self._field_error(gpu, value.fieldId, t)
            if error is not None:
                ctypes.memset(ctypes.addressof(value.value), 0, ctypes.sizeof(value.value))
                value.valueType, value.nvmlReturn = 0, error
        return values

    def _field_error(self, gpu: int, field_id: int, t: float) -> int | None:
        for fault in self.faults:
            if fault.field == field_id and fault.gpu in (None, gpu) and fault.active(t) and fault.error:
                fault.fired += 1
                return int(getattr(pynvml, f"NVMLError_{fault.error}")().value)
        return None

    def _xids_possible(self) -> bool:
        return True  # a fault may raise one, or take a GPU off the bus

    def _new_xids(self, t: float) -> list[tuple[int, ...]]:
        # a rule without `times` fires on every wait
        events = super()._new_xids(t)
        for fault in self.faults:
            if fault.xid is not None and fault.active(t):
                fault.fired += 1
                instance = () if fault.gpu_instance is None else (fault.gpu_instance,)
                events.append((fault.gpu or 0, fault.xid, *instance))
        return events


def _controlled(function: str, simulated: Callable[..., Any]) -> Callable[..., Any]:
    """NVML function `function` of FaultyNVML: the simulated one, between FaultyNVML's `_before` and `_after`."""
    @wraps(simulated)
    def call(self: FaultyNVML, *args: Any, **kwargs: Any) -> Any:
        gpu = self._gpu_of(args[0]) if args else None
        self._before(function, gpu, args)
        started = time.thread_time()
        try:
            result = simulated(self, *args, **kwargs)
        finally:
            self.cpu_seconds += time.thread_time() - started
        return self._after(function, gpu, result)
    return call


for _function in [name for name in dir(SimulatedNVML) if name.startswith("nvml")]:
    setattr(FaultyNVML, _function, _controlled(_function, getattr(FaultyNVML, _function)))
