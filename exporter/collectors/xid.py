"""XID errors, event-driven: every XID is counted once, repeats included.

nvidia-smi has no field; the driver logs `NVRM: Xid (PCI:...): 79, ...` to the kernel log. NVML:
nvmlEventSetCreate, nvmlDeviceRegisterEvents(nvmlEventTypeXidCriticalError), and a thread blocked
in nvmlEventSetWait. NVML delivers only the XIDs it classes as critical; the others appear in the
kernel log alone, which exporter.kernellog reads. Both sources report to `XidCounts`, which counts
each XID once (see there); the per-GPU collector copies the counts into the snapshot.

The thread is joined and the event set freed before NVML is shut down (event sets are not
thread-safe), a GPU that comes back after being lost is registered again (its handle and its
registration are new), and the log line is rate-limited per GPU and XID for XID storms.

Series: `xid` is the code for the codes of the catalogue (exporter.xids) and "other" for any other, so
that no source, however many codes it reports, grows the exporter's memory or series beyond the
catalogue's; `gpu_instance` is the MIG GPU instance a kernel-log XID names ("" for a whole GPU). A GPU that
falls off the bus makes every wait on the set answer GPU_IS_LOST: the watcher then moves to a new set
with the GPUs that still register, so one lost GPU never masks the others' XIDs.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import LOST_ERROR_NAMES, Absent, CallFailed, Device, GpuLost, Nvml, handle_key
from exporter.xids import BY_CODE, meaning

log = logging.getLogger(__name__)
# An event wakes the wait at once; the timeout only bounds how late a stop or a returned GPU's
# re-registration is seen. Each idle wake-up costs the daemon ~0.2 ms of CPU: 1 s, not 0.5 s.
WAIT_MS = 1000
LOG_EVERY = 60.0  # seconds between two log lines for the same GPU and XID
#: seconds within which an XID from one source (NVML, the kernel log) and the same GPU and code from
#: the other are one event: both come from the same driver report, read a poll interval or two apart
MATCH_WINDOW = 5.0
MATCH_BACKLOG = 256  # unmatched reports kept per GPU and code (an XID storm from one source alone)
OTHER = "other"  # the `xid` label of every code the catalogue does not name
NOT_ATTRIBUTED = 0xFFFFFFFF  # an event's gpuInstanceId when it is not a MIG GPU instance's (nvml.h)


def xid_label(code: int) -> str:
    """The `xid` label of `code`: the code if catalogued, else "other" (a bounded set of series)."""
    return str(code) if code in BY_CODE else OTHER


class XidCounts:
    """XID counts per GPU and code from several sources (NVML events, the kernel log), each XID once.

    The driver reports one XID both ways. A report is matched with an unmatched one of the same GPU
    and code from the other source within MATCH_WINDOW seconds: then it is that XID, already counted;
    otherwise it is counted and waits to be matched. So an XID counts once whichever source comes
    first, and n XIDs in a storm count n, whether one source sees them or both.
    Every table is keyed by GPU and `xid` label, never by raw code: bounded by the catalogue.
    Thread-safe: each source reports from its own thread.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._counts: dict[int, Counter] = {}  # gpu -> (xid label, gpu_instance) -> count
        # (gpu, xid label) -> (source, seen at, code), oldest first
        self._unmatched: dict[tuple[int, str], deque] = {}
        self._logged: dict[tuple[int, str], tuple[float, int]] = {}  # (gpu, xid label) -> (last line, unlogged)

    def add(self, index: int, code: int, source: str, gpu_instance: str = "") -> bool:
        """Report XID `code` on GPU `index` (MIG GPU instance `gpu_instance`, "" for the GPU) from `source`;
        True if it was counted (a new XID)."""
        now, label = self.clock(), xid_label(code)
        with self._lock:
            unmatched = self._unmatched.setdefault((index, label), deque(maxlen=MATCH_BACKLOG))
            while unmatched and now - unmatched[0][1] > MATCH_WINDOW:
                unmatched.popleft()
            for position, (other, _, other_code) in enumerate(unmatched):
                if other != source and other_code == code:
                    del unmatched[position]
                    return False
            unmatched.append((source, now, code))
            self._counts.setdefault(index, Counter())[(label, gpu_instance)] += 1
            line = self._due_line(index, label, now)
        if line is not None:
            log.warning("GPU %d%s: XID %d: %s%s", index, f" (GPU instance {gpu_instance})" if gpu_instance else "",
                        code, meaning(code), line)
        return True

    def _due_line(self, index: int, label: str, now: float) -> str | None:
        """At most one line per GPU and XID every LOG_EVERY seconds: its suffix, or None (caller holds the lock)."""
        last, unlogged = self._logged.get((index, label), (None, 0))
        if last is not None and now - last < LOG_EVERY:
            self._logged[(index, label)] = (last, unlogged + 1)
            return None
        self._logged[(index, label)] = (now, 0)
        return f" (and {unlogged} more since the last line)" if unlogged else ""

    def counts(self, index: int) -> dict[tuple[str, str], int]:
        """XID counts of one GPU by (xid label, gpu_instance)."""
        with self._lock:
            return dict(self._counts.get(index, {}))


class XidWatcher:
    """Counts XID events for a set of GPUs from one NVML event set, in a background thread."""

    def __init__(self, nvml: Nvml, devices: list[Device], counts: XidCounts) -> None:
        self.nvml = nvml
        self.devices = devices
        self.xid_counts = counts
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self._by_handle: dict[int, int] = {}
        self._returned: list[Device] = []

    def start(self) -> None:
        """Register for XID events; without event support, log once and count nothing."""
        try:
            self._event_set = self.nvml.call("nvmlEventSetCreate")
        except (Absent, CallFailed) as exc:
            log.info("XID events unavailable from NVML (%s): nvml_gpu_xid_errors_total counts the kernel log's "
                     "XIDs only (if it is read)", exc)
            return
        self._register_all(self.devices)
        if self._by_handle:
            self._thread = threading.Thread(target=self._run, name="xid-events", daemon=True)
            self._thread.start()

    def register(self, device: Device) -> None:
        """Register `device` again after it came back from being lost (its handle is new).

        Done by the event thread between two waits: an event set is not thread-safe.
        """
        if self._thread is None:  # no event support: nothing to register with
            return
        with self._lock:
            self._returned.append(device)

    def _register(self, device: Device) -> bool:
        """Register `device` on the current set; False if that left the set undefined (UNKNOWN)."""
        try:
            device.call("nvmlDeviceRegisterEvents", self.nvml.lib.nvmlEventTypeXidCriticalError, self._event_set)
        except (Absent, CallFailed, GpuLost) as exc:
            log.info("GPU %d: XID events unavailable (%s)", device.index, exc)
            return getattr(exc, "error", "") != "unknown"
        with self._lock:
            self._by_handle = {key: index for key, index in self._by_handle.items() if index != device.index}
            self._by_handle[handle_key(device.handle)] = device.index
        return True

    def _register_all(self, devices: list[Device], left_out: tuple[int, ...] = ()) -> None:
        """Register `devices` on the current set. A registration answered UNKNOWN leaves the set in an
        undefined state that must be freed (nvml.h): the set is renewed without that GPU, which is left
        out until it comes back (`register`)."""
        undefined = tuple(device.index for device in devices if not self._register(device))
        if undefined:
            self._renew(left_out + undefined)

    def _renew(self, left_out: tuple[int, ...] = ()) -> None:
        """Move to a new event set with every GPU that still registers (but those `left_out`), and free
        the old one.

        A GPU registered on a set that falls off the bus fails every wait on it, masking the other
        GPUs' XIDs; it is left out until it comes back (`register`). Run by the event thread only
        (or by `start`, before it runs).
        """
        try:
            event_set = self.nvml.call("nvmlEventSetCreate")
        except (Absent, CallFailed) as exc:
            log.debug("XID event set renewal failed: %s", exc)
            return
        old, self._event_set = self._event_set, event_set
        with self._lock:
            self._by_handle = {}
        self._register_all([device for device in self.devices if device.index not in left_out], left_out)
        try:
            self.nvml.call("nvmlEventSetFree", old)
        except (Absent, CallFailed) as exc:
            log.debug("freeing the old XID event set failed: %s", exc)

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop and join the thread, then free the event set; False if the thread is stuck in NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        if self._event_set is not None:
            try:
                self.nvml.call("nvmlEventSetFree", self._event_set)
            except (Absent, CallFailed) as exc:
                log.debug("freeing the XID event set failed: %s", exc)
            self._event_set = None
        return True

    def _run(self) -> None:
        xid_type = self.nvml.lib.nvmlEventTypeXidCriticalError
        while not self._stop.is_set():
            with self._lock:
                returned, self._returned = self._returned, []
            self._register_all(returned)
            try:
                data = self.nvml.call("nvmlEventSetWait", self._event_set, WAIT_MS)
            except CallFailed as exc:
                if exc.error == "timeout":  # an idle wait
                    continue
                if exc.error == "uninitialized":  # NVML was shut down under us: nothing more to wait for
                    log.debug("XID event wait: NVML is shut down; stopping")
                    return
                log.debug("XID event wait failed: %s", exc)
                if exc.error in LOST_ERROR_NAMES:
                    self._renew()
                self._stop.wait(WAIT_MS / 1000)  # never spin on an error
                continue
            except Absent as exc:
                log.debug("XID event wait failed: %s", exc)
                self._stop.wait(WAIT_MS / 1000)
                continue
            with self._lock:
                index = self._by_handle.get(handle_key(data.device))
            if data.eventType & xid_type and index is not None:
                instance = getattr(data, "gpuInstanceId", NOT_ATTRIBUTED)
                self.xid_counts.add(index, int(data.eventData), "nvml",
                                    "" if instance == NOT_ATTRIBUTED else str(instance))


class XidCollector(Collector):
    name = "xid"
    help = "XID error counts (NVML events and the kernel log)"

    def __init__(self, device, *, xid_counts: XidCounts | None = None, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.xid_counts = xid_counts

    def collect(self, ctx: SampleContext) -> None:
        counts = self.xid_counts.counts(self.device.index) if self.xid_counts else {}
        for (xid, gpu_instance), count in counts.items():
            ctx.emit("nvml_gpu_xid_errors_total", count, xid, gpu_instance)
