"""XID errors, event-driven: every XID the driver reports is counted, repeats included.

nvidia-smi has no field; the driver logs `NVRM: Xid (PCI:...): 79, ...` to the kernel log. NVML:
nvmlEventSetCreate, nvmlDeviceRegisterEvents(nvmlEventTypeXidCriticalError), and a thread blocked
in nvmlEventSetWait. The counts live here; the per-GPU collector copies them into the snapshot.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import Absent, CallFailed, Device, GpuLost, Nvml, handle_key

log = logging.getLogger(__name__)
WAIT_MS = 500


class XidWatcher:
    """Counts XID events for a set of GPUs from one NVML event set, in a background thread."""

    def __init__(self, nvml: Nvml, devices: list[Device]) -> None:
        self.nvml = nvml
        self.devices = devices
        self._counts: dict[int, Counter] = {device.index: Counter() for device in devices}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register for XID events; without event support, log once and count nothing."""
        lib = self.nvml.lib
        try:
            event_set = self.nvml.call("nvmlEventSetCreate")
        except (Absent, CallFailed, GpuLost) as exc:
            log.info("XID events unavailable (%s): nvml_gpu_xid_errors_total will not be exported", exc)
            return
        by_handle: dict[int, int] = {}
        for device in self.devices:
            try:
                device.call("nvmlDeviceRegisterEvents", lib.nvmlEventTypeXidCriticalError, event_set)
                by_handle[handle_key(device.handle)] = device.index
            except (Absent, CallFailed, GpuLost) as exc:
                log.info("GPU %d: XID events unavailable (%s)", device.index, exc)
        if by_handle:
            self._thread = threading.Thread(target=self._run, args=(event_set, by_handle), name="xid-events",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def counts(self, index: int) -> dict[str, int] | None:
        """XID counts of one GPU by code; None when the GPU is not watched."""
        if self._thread is None:
            return None
        with self._lock:
            return dict(self._counts.get(index, {}))

    def _run(self, event_set: Any, by_handle: dict[int, int]) -> None:
        xid_type = self.nvml.lib.nvmlEventTypeXidCriticalError
        while not self._stop.is_set():
            try:
                data = self.nvml.call("nvmlEventSetWait", event_set, WAIT_MS)
            except CallFailed:  # the timeout of an idle wait, mostly
                continue
            except (GpuLost, Absent) as exc:
                log.debug("event wait failed: %s", exc)
                self._stop.wait(WAIT_MS / 1000)
                continue
            index = by_handle.get(handle_key(data.device))
            if data.eventType & xid_type and index is not None:
                log.warning("GPU %d: XID %d", index, data.eventData)
                with self._lock:
                    self._counts[index][str(data.eventData)] += 1


class XidCollector(Collector):
    name = "xid"
    help = "XID error counts (NVML events)"

    def __init__(self, device, *, xid_watcher: XidWatcher | None = None, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.watcher = xid_watcher

    def collect(self, ctx: SampleContext) -> None:
        counts = self.watcher.counts(self.device.index) if self.watcher else None
        for xid, count in (counts or {}).items():
            ctx.emit("nvml_gpu_xid_errors_total", count, xid)
