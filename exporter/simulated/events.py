"""XID events: event sets, registrations and waits, as the driver keeps them. A freed or unknown set is
INVALID_ARGUMENT; nvmlShutdown frees every set and ends the waits on them (UNINITIALIZED); a set whose
GPU fell off the bus, or that a failed registration left undefined, answers its error to every wait.
The "xid" scenario sends one XID 79 per GPU."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pynvml

from exporter.simulated.driver import Driver, allocated, nvml_function
from exporter.simulated.nvml_h import H
from exporter.simulated.processes import NO_INSTANCE

POLL = 0.05  # seconds between looks for new events while a wait blocks and one may come


@dataclass
class EventSet:
    """One event set: the GPUs registered on it, and the error every wait on it answers once it went bad."""

    gpus: set[int] = field(default_factory=set)
    error: type[Exception] | None = None


class Events(Driver):
    """NVML's event functions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._event_sets: dict[int, EventSet] = {}  # by address
        self._xid_queue: list[tuple[int, ...]] = []  # (gpu, xid[, GPU instance]) drawn, not yet delivered
        self._xid_scenario_done: set[int] = set()  # GPUs whose "xid" scenario already sent its XID

    def _release(self) -> None:
        super()._release()
        self._event_sets.clear()

    def _new_xids(self, t: float) -> list[tuple[int, ...]]:
        """(gpu, xid[, GPU instance]) events that happen now: one XID 79 per GPU of the "xid" scenario."""
        due = [gpu for gpu in range(len(self.traits)) if gpu not in self._xid_scenario_done
               and self.workload.faulty(gpu, t) == "xid"]
        self._xid_scenario_done.update(due)
        return [(gpu, 79) for gpu in due]

    def _xids_possible(self) -> bool:
        """Whether a wait may end early other than by nvmlShutdown."""
        return "xid" in self.workload.scenarios

    @nvml_function
    def nvmlEventSetCreate(self) -> Any:
        where, handle = self._new_handle(pynvml.c_nvmlEventSet_t, self._keep)
        self._event_sets[where] = EventSet()
        return handle

    @nvml_function
    def nvmlEventSetFree(self, event_set: Any) -> None:
        del self._event_sets[allocated(event_set, self._event_sets)]

    @nvml_function
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        self._event_sets[allocated(event_set, self._event_sets)].gpus.add(self._gpu(handle))

    @nvml_function
    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if not self.initialized:  # shut down while waiting
                raise pynvml.NVMLError_Uninitialized()
            waited = self._event_sets[allocated(event_set, self._event_sets)]
            if waited.error is not None:
                raise waited.error()
            # Draw new events only once the pending ones are delivered: they must not queue faster
            # than the waits consume them.
            if not self._xid_queue:
                self._xid_queue.extend(self._new_xids(self._t()))
            while self._xid_queue and self._xid_queue[0][0] not in waited.gpus:
                self._xid_queue.pop(0)  # happened on a GPU not registered on this set: never delivered
            if self._xid_queue:
                gpu, xid, *instance = self._xid_queue.pop(0)  # a MIG XID names its GPU instance
                return pynvml.c_nvmlEventData_t(device=self._handles[gpu],
                                                eventType=H.nvmlEventTypeXidCriticalError, eventData=xid,
                                                gpuInstanceId=instance[0] if instance else NO_INSTANCE,
                                                computeInstanceId=NO_INSTANCE)
            if time.monotonic() >= deadline:
                raise pynvml.NVMLError_Timeout()
            # A driver blocks here. Where no XID can come, only nvmlShutdown ends the wait early: block
            # until then, instead of polling at a CPU cost (0.3 % of a core) that a driver does not have.
            pause = POLL if self._xids_possible() else deadline - time.monotonic()
            self._shut_down.wait(min(pause, max(0.0, deadline - time.monotonic())))
