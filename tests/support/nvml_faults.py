"""Fault injection for the simulated NVML (tests only): failing, hanging or missing calls, failing
fields, lost GPUs and XID events, from a list of `Fault`s or a JSON fault plan.

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
UnicodeDecodeError on invalid UTF-8 as the real binding does.
(NVMLError_<error>); `hang` sleeps inside the call; `xid` raises XID events. A registration for
events that fails with "Unknown" leaves its event set undefined, as nvml.h says: waits on it fail.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, fields as dataclass_fields
from typing import Any

import pynvml

from exporter.simulated import DeviceTraits, SimulatedNVML


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


class FaultyNVML(SimulatedNVML):
    """The simulated NVML with `faults` applied to its calls, fields and events."""

    def __init__(self, *args: Any, faults: list[Fault] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = list(faults or [])

    def _enter(self, function: str, gpu: int | None) -> None:
        super()._enter(function, gpu)
        t = self._t()
        for fault in self.faults:
            if fault.answer is None and fault.active(t) and fault.matches_call(function, gpu):
                fault.fired += 1
                if fault.hang:
                    time.sleep(fault.hang)
                if fault.error == "GpuIsLost" and fault.function == "*":
                    self.fall_off_bus(gpu)
                if fault.error:
                    raise getattr(pynvml, f"NVMLError_{fault.error}")()

    def _leave(self, function: str, gpu: int | None, result: Any) -> Any:
        t = self._t()
        for fault in self.faults:
            if fault.answer is not None and fault.active(t) and fault.matches_call(function, gpu):
                fault.fired += 1
                if fault.answer_field is None:
                    return pynvml.convertStrBytes(lambda: fault.answer)()
                setattr(result, fault.answer_field, fault.answer)  # a pynvml struct: decoded when read
                return result
        return result

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        try:
            super().nvmlDeviceRegisterEvents(handle, event_types, event_set)
        except pynvml.NVMLError_Unknown:  # nvml.h: the set is then undefined and must be freed
            self.undefine_event_set(event_set)
            raise

    def _field_error(self, gpu: int, field_id: int, t: float) -> int | None:
        for fault in self.faults:
            if fault.field == field_id and fault.gpu in (None, gpu) and fault.active(t) and fault.error:
                fault.fired += 1
                return getattr(pynvml, f"NVMLError_{fault.error}")().value
        return None

    def _new_xids(self, t: float) -> list[tuple[int, ...]]:
        # a rule without `times` fires on every wait
        events = []
        for fault in self.faults:
            if fault.xid is not None and fault.active(t):
                fault.fired += 1
                instance = () if fault.gpu_instance is None else (fault.gpu_instance,)
                events.append((fault.gpu or 0, fault.xid, *instance))
        return events
