"""The only boundary between the exporter and NVML: calls, error mapping and version fallbacks.

The NVML library is an injected module object: the real `pynvml` by default, the simulated one from
`exporter.simulated` only under `--simulate`. Every NVML error is classified here, once:

* NOT_SUPPORTED / FUNCTION_NOT_FOUND (or a binding without the function, or nvidia-ml-py >= 12.560's
  NVMLLibraryMismatchError, a plain Exception it raises where the driver lacks the versioned entry point
  it calls, as R470/R510 lack nvmlDeviceGetComputeRunningProcesses_v3) -> `Absent`: the GPU or driver
  lacks the reading. It is remembered per device and asked again only every REPROBE_AFTER seconds: a
  reading can appear after start (NVLink fields once the fabric manager is up, a field after a driver
  update or a MIG mode change).
* GPU_IS_LOST / UNKNOWN / RESET_REQUIRED -> `GpuLost` only if a cheap probe of the same GPU
  (nvmlDeviceGetMemoryInfo on the GPU itself, also for a call on one of its MIG devices) fails the
  same way too; otherwise one sensor is broken, not the GPU, and the error is a `CallFailed` like any
  other (one bad sensor must not drop every series of its GPU). A system-level call (`Nvml.call`:
  GPM buffers and metrics, handles by index or UUID) has no GPU to probe: always `CallFailed`.
* an AttributeError raised inside the binding is a bug (of the binding or of ours): logged with its
  traceback once per function, then counted as `CallFailed("binding_error")`.
* anything else -> `CallFailed(error)`: one failed reading, counted by the caller.

Text (driver version, names, UUIDs, serials, a struct's bus id...) is never trusted to be UTF-8:
pynvml decodes it strictly and raises UnicodeDecodeError, so `invoke` answers it decoded with U+FFFD
replacements, and so do `text_field` for struct fields and `as_text` for the bytes older bindings give.

Constants newer than the oldest supported binding are read through `constant()`, which falls back
to their nvml.h value (NEWER_CONSTANTS): an old nvidia-ml-py then still starts.
"""
from __future__ import annotations

import ctypes
import logging
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

_ABSENT_ERRORS = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")
_LOST_ERRORS = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNKNOWN", "NVML_ERROR_RESET_REQUIRED")
#: the short names (`Nvml.error_name`) of the errors that may mean a lost GPU
LOST_ERROR_NAMES = frozenset(name[len("NVML_ERROR_"):].lower() for name in _LOST_ERRORS)
PROBE = "nvmlDeviceGetMemoryInfo"  # answered by every GPU and driver, costs one driver round trip
REPROBE_AFTER = 300.0  # seconds a reading found absent is not asked for (then asked once again)

#: NVML constants the exporter uses that the oldest supported nvidia-ml-py (12.535.108) lacks, with
#: their values from nvml.h (and the binding release that added them).
NEWER_CONSTANTS: dict[str, int] = {
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 197,  # 12.555
    "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 198,  # 12.555
    "NVML_VALUE_TYPE_UNSIGNED_SHORT": 6,  # 12.560
    "NVML_FI_DEV_NVLINK_COUNT_XMIT_BYTES": 202,  # NVLink5 (Blackwell) byte counters, after 12.535
    "NVML_FI_DEV_NVLINK_COUNT_RCV_BYTES": 204,
}


def constant(lib: ModuleType, name: str) -> int:
    """An NVML constant from the binding, or its nvml.h value where the binding predates it."""
    value = getattr(lib, name, None)
    return NEWER_CONSTANTS[name] if value is None else value


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used at all (no driver, no libnvidia-ml): the daemon cannot start."""


class Absent(Exception):
    """The device or driver does not provide this reading: export no sample, count no error."""


class GpuLost(Exception):
    """The device stopped answering (fallen off the bus, needs reset, unknown state)."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


class CallFailed(Exception):
    """One NVML call or field failed with an error that does not condemn the whole device."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


def error_names(lib: ModuleType) -> dict[int, str]:
    """Map NVML return codes to short names: 15 -> "gpu_is_lost". pynvml raises NVMLError(NVML_SUCCESS)
    where a size query succeeds with nothing to size (nvmlDeviceGetProcessUtilization without samples):
    "success", for the caller to take as an empty answer."""
    return {lib.NVML_SUCCESS: "success",
            **{getattr(lib, name): name[len("NVML_ERROR_"):].lower()
               for name in dir(lib) if name.startswith("NVML_ERROR_") and isinstance(getattr(lib, name), int)}}


def handle_key(handle: Any) -> int:
    """A stable integer identity for a device handle (a ctypes pointer)."""
    return ctypes.cast(handle, ctypes.c_void_p).value or id(handle)


#: A numeric field of an NVML struct, read through ctypes' own field descriptor: pynvml's structs
#: override `__getattribute__` in Python (only to decode text fields), which made reading a field
#: batch cost more than the call itself. Never for text fields (`text_field` decodes those).
read_field: Callable[[Any, str], Any] = object.__getattribute__


def as_text(value: Any) -> str:
    """An NVML string (bytes in older bindings, str in newer ones) as str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def text_field(struct: Any, name: str) -> str:
    """A text field of an NVML struct as str; pynvml's structs decode it strictly when it is read."""
    try:
        return as_text(getattr(struct, name))
    except UnicodeDecodeError as exc:
        return _replaced(exc)


def _replaced(exc: UnicodeDecodeError) -> str:
    """The text whose strict decoding failed, decoded with U+FFFD for the bytes that are not UTF-8."""
    return exc.object.decode("utf-8", errors="replace")


class Nvml:
    """An initialised NVML library plus the error policy above."""

    def __init__(self, lib: ModuleType) -> None:
        self.lib = lib
        self._names = error_names(lib)
        self._absent = {getattr(lib, n) for n in _ABSENT_ERRORS}
        # In a field batch, INVALID_ARGUMENT means the driver does not know the field id (older
        # drivers) or the scope (a link the GPU does not have): absent for that field, as NOT_SUPPORTED.
        self._absent_field = self._absent | {lib.NVML_ERROR_INVALID_ARGUMENT}
        self._lost = {getattr(lib, n) for n in _LOST_ERRORS}
        # nvidia-ml-py >= 12.560 only: `except ()` catches nothing with an older binding
        self._mismatch = tuple(filter(None, [getattr(lib, "NVMLLibraryMismatchError", None)]))
        self.calls = 0  # system-level calls; devices count their own
        self.device_count: int | None = None  # what nvmlDeviceGetCount answered, opened or not
        self.value_types = value_types(lib)
        entry = lib.c_nvmlFieldValue_t  # a field batch's entry: its size, where valueType, nvmlReturn and value lie
        self.field_layout = (ctypes.sizeof(entry), entry.valueType.offset, entry.nvmlReturn.offset, entry.value.offset)
        self.success = lib.NVML_SUCCESS
        self._binding_bugs: set[str] = set()

    def init(self) -> None:
        """nvmlInit, turning a missing driver or library into `NvmlUnavailable`."""
        try:
            self.lib.nvmlInit()
        except self.lib.NVMLError as exc:
            raise NvmlUnavailable(f"cannot initialise NVML ({exc}); is the NVIDIA driver installed and "
                                  "libnvidia-ml.so.1 on the library path?") from exc
        except OSError as exc:
            raise NvmlUnavailable(f"cannot load libnvidia-ml ({exc})") from exc

    def shutdown(self) -> None:
        try:
            self.lib.nvmlShutdown()
        except self.lib.NVMLError:
            pass

    def error_name(self, exc: BaseException) -> str:
        value = getattr(exc, "value", None)
        fallback = type(exc).__name__.lower()
        return self._names.get(value, fallback) if isinstance(value, int) else fallback

    def classify(self, exc: BaseException) -> Exception:
        """The exporter exception for an NVML exception (see the module docstring), before any probe."""
        value = getattr(exc, "value", None)
        if value in self._absent:
            return Absent(self.error_name(exc))
        if value in self._lost:
            return GpuLost(self.error_name(exc))
        return CallFailed(self.error_name(exc))

    def function(self, name: str) -> Any:
        """The binding's function `name`; `Absent` when this nvidia-ml-py does not have it."""
        function = getattr(self.lib, name, None)
        if function is None:
            raise Absent("not_in_binding")
        return function

    def invoke(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call binding function `name`, mapping its errors (lost-class errors unprobed)."""
        function = self.function(name)
        try:
            return function(*args, **kwargs)
        except self.lib.NVMLError as exc:
            raise self.classify(exc) from exc
        except UnicodeDecodeError as exc:  # the binding decodes text strictly; drivers do not promise UTF-8
            return _replaced(exc)
        except self._mismatch as exc:  # the driver lacks the entry point this binding calls
            raise Absent("function_not_found") from exc
        except AttributeError as exc:  # raised inside the binding: a bug, not an absent reading
            if name not in self._binding_bugs:
                self._binding_bugs.add(name)
                log.error("bug: %s raised AttributeError inside the NVML binding; counted as "
                          "error=\"binding_error\"", name, exc_info=True)
            raise CallFailed("binding_error") from exc

    def call(self, function: str, *args: Any, **kwargs: Any) -> Any:
        """Call a system-level NVML function: Absent or CallFailed, never GpuLost (no GPU to probe)."""
        self.calls += 1
        try:
            return self.invoke(function, *args, **kwargs)
        except GpuLost as exc:
            raise CallFailed(exc.error) from exc

    def driver_info(self) -> tuple[str, str]:
        """(driver_version, cuda_driver_version) such as ("550.54.15", "12.4"); "" when unknown."""
        try:
            driver = as_text(self.call("nvmlSystemGetDriverVersion"))
        except Exception:  # noqa: BLE001 - identity is best effort
            driver = ""
        try:
            cuda = int(self.call("nvmlSystemGetCudaDriverVersion_v2"))
            cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except Exception:  # noqa: BLE001
            cuda_text = ""
        return driver, cuda_text

    def devices(self) -> list[Device]:
        """Open every GPU and read its static identity (once)."""
        devices = []
        self.device_count = self.call("nvmlDeviceGetCount")
        for index in range(self.device_count):
            try:
                devices.append(Device.open(self, index))
            except (Absent, CallFailed, GpuLost) as exc:  # without a UUID it cannot be labelled
                log.error("GPU %d cannot be opened (%s): not exported; restart the exporter once it is back",
                          index, exc)
        return devices


@dataclass
class Device:
    """One GPU: its handle, static identity, and what it is known not to support."""

    nvml: Nvml
    index: int
    handle: Any
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    mig_mode: str = ""
    absent: dict = field(default_factory=dict)  # what was found absent -> when to ask again (clock seconds)
    static: dict = field(default_factory=dict)
    calls: int = 0
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def open(cls, nvml: Nvml, index: int) -> Device:
        handle = nvml.call("nvmlDeviceGetHandleByIndex", index)
        device = cls(nvml, index, handle, uuid=as_text(nvml.call("nvmlDeviceGetUUID", handle)))
        device.name = as_text(device.optional("nvmlDeviceGetName") or "")
        pci = device.optional("nvmlDeviceGetPciInfo_v3")
        device.pci_bus_id = text_field(pci, "busId") if pci is not None else ""
        device.read_mig_mode()
        return device

    def read_mig_mode(self) -> None:
        """Read the current MIG mode ("" where the GPU has none): it changes with `nvidia-smi -mig` and a
        GPU reset while the exporter runs."""
        mig = self.optional("nvmlDeviceGetMigMode")
        self.mig_mode = "" if mig is None else ("enabled" if mig[0] else "disabled")

    def reopen(self) -> None:
        """Re-acquire the handle of a lost GPU by its UUID; raises if it is still unreachable.

        Reachable means what `answers_probe` means: an answer with an error of its own
        (NO_PERMISSION for an unprivileged exporter under MIG, NOT_SUPPORTED) is an answer.
        """
        # pynvml passes this argument straight to ctypes.c_char_p: it must be bytes.
        self.handle = self.nvml.call("nvmlDeviceGetHandleByUUID", self.uuid.encode())
        if not self.answers_probe():
            raise GpuLost("probe_failed")

    def call(self, function: str, *args: Any, **kwargs: Any) -> Any:
        """Call a per-device NVML function; raises Absent, GpuLost or CallFailed.

        A function found absent (NOT_SUPPORTED, FUNCTION_NOT_FOUND) is not called again. Absence is
        remembered per function and first argument, so one fan or clock can be absent alone.
        A lost-class error (GPU_IS_LOST, UNKNOWN, RESET_REQUIRED) is `GpuLost` only if the probe fails too.
        """
        return self.call_on(self.handle, function, *args, **kwargs)

    def call_on(self, handle: Any, function: str, *args: Any, **kwargs: Any) -> Any:
        """`call` with another handle of this GPU: one of its MIG devices (absence remembered apart)."""
        key = _absent_key(function, args)
        if handle is not self.handle:
            key = ("mig", *key)
        if self.remembers_absent(key):
            raise Absent("remembered")
        self.calls += 1
        try:
            return self.nvml.invoke(function, handle, *args, **kwargs)
        except Absent as exc:
            log.debug("GPU %d: %s%s not supported (%s); asking again in %.0f s", self.index, function, args[:1],
                      exc, REPROBE_AFTER)
            self.found_absent(key)
            raise
        except GpuLost as exc:
            is_probe = function == PROBE and handle is self.handle and not args and not kwargs
            if not is_probe and self.answers_probe():
                raise CallFailed(exc.error) from exc
            raise

    def answers_probe(self) -> bool:
        """True if the device still answers the cheap probe call."""
        self.calls += 1
        try:
            self.nvml.invoke(PROBE, self.handle)
        except GpuLost:
            return False
        except (Absent, CallFailed):
            return True  # it answered, with an error of its own
        return True

    def call_first(self, functions: Sequence[str], *args: Any) -> Any:
        """Call the first of several equivalent functions (newest name first) that exists."""
        for function in functions[:-1]:
            try:
                return self.call(function, *args)
            except Absent:
                continue
        return self.call(functions[-1], *args)

    def optional(self, function: str, *args: Any) -> Any:
        """A static reading that may be absent or fail: None then."""
        try:
            return self.call(function, *args)
        except (Absent, CallFailed):
            return None

    def found_absent(self, key: Any) -> None:
        """Remember that `key` (a call or a field) is absent: not asked for again until REPROBE_AFTER."""
        self.absent[key] = self.clock() + REPROBE_AFTER

    def remembers_absent(self, key: Any) -> bool:
        """True while `key` was found absent less than REPROBE_AFTER ago (then it is forgotten, and asked)."""
        again_at = self.absent.get(key)
        if again_at is None:
            return False
        if self.clock() < again_at:
            return True
        del self.absent[key]
        return False

    def lacks(self, function: str, *args: Any) -> bool:
        """True if `call(function, *args)` was found absent (and so is not made until it is re-probed)."""
        return self.remembers_absent(_absent_key(function, args))

    def lacks_field(self, field_id: int, scope: int = 0) -> bool:
        """True if the GPU answered NOT_SUPPORTED for this field, or the driver has no field batches."""
        return self.remembers_absent(("field", (field_id, scope))) or self.lacks("nvmlDeviceGetFieldValues")

    def field_values(self, fields: Iterable[tuple[int, int]]) -> dict[tuple[int, int], FieldValue | CallFailed]:
        """Read many fields in ONE nvmlDeviceGetFieldValues call.

        `fields` are (field_id, scope_id) pairs. Returns {pair: FieldValue or CallFailed}; fields the GPU
        does not support (NOT_SUPPORTED, or INVALID_ARGUMENT for an id or scope the driver does not
        know) are left out of the result and not requested again until they are re-probed.
        """
        wanted = [f for f in dict.fromkeys(fields) if not (self.absent and self.remembers_absent(("field", f)))]
        if not wanted:
            return {}
        values = self.call("nvmlDeviceGetFieldValues", wanted)
        nvml = self.nvml
        # read from the array's memory, by the struct's layout, rather than member by member: the batch is
        # read at every sample of every GPU
        memory, (size, type_at, return_at, value_at) = bytes(values), nvml.field_layout
        result: dict[tuple[int, int], FieldValue | CallFailed] = {}
        for pair, at in zip(wanted, range(0, len(memory), size)):
            returned = _UINT.unpack_from(memory, at + return_at)[0]
            if returned == nvml.success:
                kind = _UINT.unpack_from(memory, at + type_at)[0]
                result[pair] = union_value(nvml.value_types, kind, memory, at + value_at)
            elif returned in nvml._absent_field:
                self.found_absent(("field", pair))
            else:
                result[pair] = CallFailed(nvml._names.get(returned, str(returned)))
        return result


def _absent_key(function: str, args: Sequence[Any]) -> tuple:
    """What absence is remembered by: the function and its first argument when that is a number or name."""
    return function, tuple(args[:1]) if args and isinstance(args[0], (int, str)) else ()


#: NVML_VALUE_TYPE_* name -> the struct format of that c_nvmlValue_t member (native sizes, as ctypes'
#: c_double, c_uint, c_ulong, ... have), and whether it is unsigned
_VALUE_TYPES = {"DOUBLE": ("d", False), "UNSIGNED_INT": ("I", True), "UNSIGNED_LONG": ("L", True),
                "UNSIGNED_LONG_LONG": ("Q", True), "SIGNED_LONG_LONG": ("q", False), "SIGNED_INT": ("i", False),
                "UNSIGNED_SHORT": ("H", True)}


class FieldValue(NamedTuple):  # a tuple, not a frozen dataclass: built ~20 times per GPU and sample, 4 times faster
    """One value of a field batch: the number and, for an unsigned integer, the width it wraps at."""

    value: float
    bits: int | None  # None: a double or a signed value (no wrap)


def value_types(lib: ModuleType) -> dict[int, tuple[struct.Struct, int | None]]:
    """NVML_VALUE_TYPE_* tag -> (layout of the union member holding it, unsigned width in bits or None)."""
    return {constant(lib, f"NVML_VALUE_TYPE_{kind}"):
            (struct.Struct(layout), 8 * struct.calcsize(layout) if unsigned else None)
            for kind, (layout, unsigned) in _VALUE_TYPES.items()}


_UNKNOWN_TYPE = (struct.Struct(ctypes.c_ulonglong._type_), 64)  # a tag this binding does not know: the widest
_UINT = struct.Struct(ctypes.c_uint._type_)  # valueType and nvmlReturn of a c_nvmlFieldValue_t


def union_value(types: dict[int, tuple[struct.Struct, int | None]], kind: int, union: Any,
                offset: int = 0) -> FieldValue:
    """The number in a c_nvmlValue_t union (at `offset` in `union`'s memory), read by its NVML_VALUE_TYPE_* tag.

    Read through the C type, not the binding's member name: nvidia-ml-py 12.535.108's union has no
    `usVal`, yet a driver may answer NVML_VALUE_TYPE_UNSIGNED_SHORT.
    """
    layout, bits = types.get(kind, _UNKNOWN_TYPE)
    return FieldValue(layout.unpack_from(union, offset)[0], bits)


def union_layout(types: dict[int, tuple[struct.Struct, int | None]], kind: int) -> struct.Struct:
    """The layout of the c_nvmlValue_t member an NVML_VALUE_TYPE_* tag names (`union_value` for many values
    of one tag: `union_layout(...).unpack_from(union)[0]`)."""
    return types.get(kind, _UNKNOWN_TYPE)[0]
