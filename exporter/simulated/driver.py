"""The simulated driver's base: a module object that looks like `pynvml`, the device handles it hands
out (GPUs and their MIG devices), and its lifecycle (nothing answers before nvmlInit or after
nvmlShutdown, and shutdown frees what the caller allocated). The NVML functions live in the modules
next to this one, each a mixin of `Driver`; `exporter.simulated.SimulatedNVML` puts them together.
"""
from __future__ import annotations

import ctypes
import threading
import time
import types
from collections.abc import Callable, Container, Sequence
from functools import wraps
from typing import Any, TypeVar, cast

import pynvml

from exporter.simulated.nvml_h import NVML_H
from exporter.simulated.workload import MIG_INSTANCES, DeviceTraits, Workload, simulated_uuid

F = TypeVar("F", bound=Callable[..., Any])
JITTER = 0.3  # the driver's sample spacing is not regular: each entry is up to +-JITTER/2 periods off its slot


def nvml_function(method: F) -> F:
    """Mark a method as an NVML function: refused (UNINITIALIZED) outside nvmlInit..nvmlShutdown, and
    `call_cost` slept first, as a call into the driver takes time."""
    name = method.__name__

    @wraps(method)
    def call(self: Driver, *args: Any, **kwargs: Any) -> Any:
        if not self.initialized and name != "nvmlInit":
            raise pynvml.NVMLError_Uninitialized()
        if self.call_cost:
            time.sleep(self.call_cost)
        return method(self, *args, **kwargs)
    return cast(F, call)


def is_nvml_function(name: str, value: Any) -> bool:
    """Whether `value`, named `name` in pynvml, is one of its functions (not a constant, struct or error)."""
    return isinstance(value, types.FunctionType) and name.startswith("nvml")


def address(handle: Any) -> int | None:
    """The address a ctypes handle points at; None for anything that is no pointer."""
    try:
        value: int | None = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
    return value


def allocated(handle: Any, live: Container[int]) -> int:
    """The address of `handle`, one of the `live` ones the caller allocated; INVALID_ARGUMENT for a freed
    or unknown one."""
    where = address(handle)
    if where is None or where not in live:
        raise pynvml.NVMLError_InvalidArgument()
    return where


class Driver:
    """A stand-in for the `pynvml` module. Attribute access falls through to pynvml for constants,
    structs and error classes; pynvml functions not simulated raise AttributeError, as on an old driver."""

    def __init__(self, scenario: str | Sequence[str] = "healthy", gpus: int = 2, *,
                 devices: dict[int, DeviceTraits] | None = None, call_cost: float = 0.0,
                 phase_seconds: float = 300.0, leak_minutes: float = 30.0) -> None:
        self.traits = [(devices or {}).get(i, DeviceTraits()) for i in range(gpus)]
        self.workload = Workload((scenario,) if isinstance(scenario, str) else tuple(scenario), self.traits,
                                 phase_seconds=phase_seconds, leak_minutes=leak_minutes)
        self.call_cost = call_cost
        self.start = self.clock()
        self._lock = threading.Lock()
        self._keep: list[ctypes.Array[ctypes.c_char]] = []  # behind the handles the caller allocated
        self._device_buffers: list[ctypes.Array[ctypes.c_char]] = []  # behind the device handles
        self._handles: list[Any] = []
        self._by_address: dict[int, int] = {}
        for gpu in range(gpus):
            where, handle = self._new_handle(pynvml.c_nvmlDevice_t, self._device_buffers)
            self._handles.append(handle)
            self._by_address[where] = gpu
        # MIG devices: MIG_INSTANCES GPU instances (ids 1, 2, ...) on each GPU with the `mig` trait, each
        # with `compute_instances` compute instances: one MIG device (handle, MIG-UUID) per compute instance
        self._mig_devices: dict[int, list[Any]] = {}  # GPU -> its MIG device handles, in slot order
        self._mig_by_address: dict[int, tuple[int, int, int]] = {}  # -> (GPU, GPU instance, compute instance)
        for gpu, traits in enumerate(self.traits):
            for instance in range(1, MIG_INSTANCES + 1) if traits.mig else ():
                for compute in range(traits.compute_instances):
                    where, handle = self._new_handle(pynvml.c_nvmlDevice_t, self._device_buffers)
                    self._mig_devices.setdefault(gpu, []).append(handle)
                    self._mig_by_address[where] = (gpu, instance, compute)
        self._uuids = [simulated_uuid(i) for i in range(gpus)]
        self.initialized = False
        self._shut_down = threading.Event()  # wakes event waits at nvmlShutdown
        # pynvml's constants, structs and errors as instance attributes: lookups as fast as on the module.
        self.__dict__.update({name: value for name, value in vars(pynvml).items()
                              if not name.startswith("_") and not is_nvml_function(name, value)})
        self.__dict__.update(NVML_H)

    # --- module emulation -------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if is_nvml_function(name, value):
            raise AttributeError(f"simulated NVML has no {name}")
        return value

    def __dir__(self) -> list[str]:
        return sorted(set(dir(pynvml)) | set(super().__dir__()))

    def clock(self) -> float:
        """The time the driver stamps its answers with (seconds since the epoch)."""
        return time.time()

    def _t(self) -> float:
        """Seconds since the simulation started: the workload's time."""
        return self.clock() - self.start

    def _sample_stamp(self, key: int, tick: int, period: float) -> int:
        """The driver timestamp (microseconds) of sample buffer entry `tick` (a sample `period`) of a GPU or a
        process (`key`): its slot, jittered (the same on every read)."""
        offset = ((tick * 2654435761 + key * 40503) % 1000 / 1000 - 0.5) * JITTER  # in ticks
        return int((self.start + (tick + offset) * period) * 1e6)

    # --- handles ----------------------------------------------------------------------------------
    @staticmethod
    def _new_handle(kind: Any, keep: list[ctypes.Array[ctypes.c_char]]) -> tuple[int, Any]:
        """A fresh opaque handle of ctypes pointer type `kind`, and its address; `keep` holds what it points at."""
        buffer = (ctypes.c_char * 8)()
        keep.append(buffer)
        return ctypes.addressof(buffer), ctypes.cast(buffer, kind)

    def _gpu_of(self, handle: Any) -> int | None:
        """The GPU a handle (or a UUID, as nvmlDeviceGetHandleByUUID takes it) names, if any."""
        if isinstance(handle, bytes):
            uuid = handle.decode()
            return self._uuids.index(uuid) if uuid in self._uuids else None
        where = address(handle)
        if where is None:
            return None
        if where in self._mig_by_address:
            return self._mig_by_address[where][0]
        return self._by_address.get(where)

    def _gpu(self, handle: Any) -> int:
        """The GPU of a device handle; INVALID_ARGUMENT for anything else."""
        gpu = self._gpu_of(handle)
        if gpu is None:
            raise pynvml.NVMLError_InvalidArgument()
        return gpu

    def _mig_of(self, handle: Any) -> tuple[int, int, int] | None:
        """(parent GPU, GPU instance id, compute instance id) of a MIG device handle; None for a whole GPU."""
        where = address(handle)
        return None if where is None else self._mig_by_address.get(where)

    def _check_privilege(self, gpu: int, handle: Any) -> None:
        """NO_PERMISSION for the parent handle of a GPU in MIG mode (nvml.h: memory and process lists there
        need "appropriate privileges"; the driver checks CAP_SYS_ADMIN, which the simulator's caller does
        not hold). A MIG device's own handle answers."""
        if self.traits[gpu].mig and self._mig_of(handle) is None:
            raise pynvml.NVMLError_NoPermission()

    # --- lifecycle --------------------------------------------------------------------------------
    def _release(self) -> None:
        """What nvmlShutdown frees (under the lock); each part of the driver adds its own."""
        self._keep.clear()

    @nvml_function
    def nvmlInit(self) -> None:
        self.initialized = True
        self._shut_down.clear()

    @nvml_function
    def nvmlShutdown(self) -> None:
        self.initialized = False
        self._shut_down.set()
        with self._lock:
            self._release()
