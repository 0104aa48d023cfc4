"""The background sampler: one thread per GPU builds immutable samples; scrapes only read them.

Each GPU has its own thread so a GPU that hangs in an NVML call or falls off the bus stalls or drops
only its own series. A watchdog (driven by the daemon's main loop) reports a call that hangs while it
hangs, through `nvml_exporter_errors_total{error="timeout"}` and the snapshot age.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

from exporter.collectors import BY_NAME, Collector, SampleContext, XidCounts, XidWatcher
from exporter.collectors.base import Values
from exporter.collectors.identity import IdentityCollector
from exporter.collectors.processes import in_host_pid_namespace
from exporter.kernellog import KernelLogReader
from exporter.nvml import Absent, CallFailed, Device, GpuLost, Nvml
from exporter.textformat import sample_lines

log = logging.getLogger(__name__)


class CollectorRun(NamedTuple):  # a tuple: one per collector and sample
    success: bool
    duration: float


@dataclass(frozen=True)
class GpuSample:
    """Everything known about one GPU at one moment. Never mutated after publication."""

    index: int
    uuid: str
    taken_at: float
    values: Values
    runs: dict[str, CollectorRun]
    lines: tuple[bytes, ...]  # textformat.sample_lines of `values`, rendered once here instead of on every scrape


@dataclass(frozen=True)
class GpuSnapshot:
    """The latest sample of every GPU, and which GPUs are lost."""

    samples: tuple[GpuSample, ...] = ()
    lost: frozenset[int] = frozenset()


class Stats:
    """Counters shared by the sampler threads: errors and GPU losses."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: Counter = Counter()
        self._lost: Counter = Counter()

    def error(self, collector: str, error: str) -> None:
        with self._lock:
            self._errors[(collector, error)] += 1

    def lost(self, device: Device) -> None:
        with self._lock:
            self._lost[(str(device.index), device.uuid)] += 1

    def errors(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._errors)

    def losses(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._lost)


class GpuSnapshotStore:
    """Holds the current GpuSnapshot; publishing swaps in a new one (readers never lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = GpuSnapshot()
        self._samples: dict[int, GpuSample] = {}  # what `current` holds, by GPU index in index order

    def publish(self, index: int, sample: GpuSample | None) -> None:
        """Replace GPU `index`'s sample, or mark it lost when `sample` is None."""
        with self._lock:
            lost = self.current.lost
            if sample is None:
                self._samples.pop(index, None)
                lost = lost | {index}
            elif index in self._samples:  # the usual case: a new sample of a GPU already there
                self._samples[index] = sample
            else:
                self._samples = dict(sorted({**self._samples, index: sample}.items()))
                lost = lost - {index}
            self.current = GpuSnapshot(tuple(self._samples.values()), lost)


def samples_per_period(period: float, interval: float) -> int:
    """How many samples of `interval` seconds apart make a collector's `period` (seconds): at least one, so
    a period shorter than the interval runs at every sample."""
    return max(1, round(period / interval))


class GpuSampler:
    """Samples one GPU every interval with the enabled collectors."""

    def __init__(self, device: Device, collectors: list[Collector], store: GpuSnapshotStore, stats: Stats, *,
                 interval: float, simulated: bool = False, clock: Callable[[], float] = time.monotonic,
                 on_return: Callable[[Device], None] = lambda device: None) -> None:
        self.device = device
        self.collectors = collectors
        self.store = store
        self.stats = stats
        self.interval = interval
        self.simulated = simulated
        self.clock = clock
        self.on_return = on_return  # called when a lost GPU answers again (the XID watcher re-registers it)
        self.retry_interval = max(interval, 1.0)
        self.samples_taken = 0
        self.lost = False
        self.retry_at = 0.0
        self.busy_since: float | None = None
        self.busy_in = ""
        self.hang_reported = False
        self._latest: dict[str, tuple[Values, CollectorRun]] = {}
        self._rendered: tuple[str, Values, tuple[bytes, ...]] | None = None  # uuid, values, lines of the last sample
        self._texts: dict[tuple[str, tuple[str, ...]], str] = {}  # its series as written (see sample_lines)
        every = {id(c): samples_per_period(c.period, interval) for c in collectors}
        slow = [c for c in collectors if every[id(c)] > 1]
        phase = {id(c): position % every[id(c)] for position, c in enumerate(slow)}
        # which collectors run (and which fields they read: static) at each sample of the cycle, and at the first
        due = [[c for c in collectors if (taken + phase.get(id(c), 0)) % every[id(c)] == 0]
               for taken in range(math.lcm(*every.values()))]
        self._plans = [(plan, tuple(chain.from_iterable(c.fields() for c in plan))) for plan in [collectors, *due]]

    def _plan(self) -> tuple[list[Collector], tuple[tuple[int, int], ...]]:
        """The collectors due at this sample and the fields they read."""
        return self._plans[0 if self.samples_taken == 0 else 1 + self.samples_taken % (len(self._plans) - 1)]

    def sample_once(self) -> None:
        """Take one sample and publish it; a lost GPU is retried every `retry_interval`."""
        now = self.clock()
        if self.lost and (now < self.retry_at or not self._recover(now)):
            return
        self.busy_since = now
        try:
            self._sample(now)
        except GpuLost as exc:
            self._mark_lost(now, exc.error)
        finally:
            self.busy_since = None
            self.hang_reported = False

    def _sample(self, now: float) -> None:
        due, wanted = self._plan()
        self.busy_in = "fields"
        try:
            fields = self.device.field_values(wanted)
        except Absent:  # a driver without nvmlDeviceGetFieldValues: collectors fall back or go without
            fields = {}
        except CallFailed as exc:
            fields = dict.fromkeys(wanted, exc)
        for collector in due:
            self.busy_in = collector.name
            ctx = SampleContext(self.device, fields, now)
            started = time.perf_counter()
            try:
                collector.collect(ctx)
            except GpuLost:
                raise
            except Exception as exc:  # a collector bug must not stop the sampler
                log.exception("GPU %d: collector %s failed", self.device.index, collector.name)
                ctx.errors.append(type(exc).__name__)
            for error in ctx.errors:
                self.stats.error(collector.name, error)
            self._latest[collector.name] = (ctx.values, CollectorRun(not ctx.errors, time.perf_counter() - started))
        self.samples_taken += 1
        values: Values = {}
        for collector_values, _ in self._latest.values():  # never mutated once collected: shared, not copied
            if values.keys().isdisjoint(collector_values):  # the usual case: no other collector has these metrics
                values.update(collector_values)
                continue
            for metric, series in collector_values.items():
                values[metric] = {**values[metric], **series} if metric in values else series
        runs = {name: run for name, (_, run) in self._latest.items()}
        previous = self._rendered[1:] if self._rendered and self._rendered[0] == self.device.uuid else None
        lines = sample_lines(self.device.index, self.device.uuid, values, previous, self._texts)
        self._rendered = (self.device.uuid, values, lines)
        self.store.publish(self.device.index, GpuSample(self.device.index, self.device.uuid, now, values, runs, lines))

    def _mark_lost(self, now: float, error: str) -> None:
        if not self.lost:
            log.error("GPU %d (%s) lost: %s; its series are dropped until it answers again",
                      self.device.index, self.device.uuid, error)
            self.stats.lost(self.device)
        self.lost = True
        self.retry_at = now + self.retry_interval
        self.store.publish(self.device.index, None)

    def _recover(self, now: float) -> bool:
        try:
            self.device.reopen()
        except (GpuLost, CallFailed, Absent):  # still unreachable
            self.retry_at = now + self.retry_interval
            return False
        except Exception:  # a bug: say so, keep retrying
            log.exception("GPU %d: re-opening failed", self.device.index)
            self.retry_at = now + self.retry_interval
            return False
        log.warning("GPU %d (%s) is back", self.device.index, self.device.uuid)
        self.lost = False
        for collector in self.collectors:
            collector.restart()
        self.on_return(self.device)
        return True

    def check_hang(self, hang_after: float) -> None:
        """Count a timeout once if the current sample has been running longer than `hang_after`."""
        started = self.busy_since
        if started is not None and not self.hang_reported and self.clock() - started > hang_after:
            self.hang_reported = True
            log.error("GPU %d: NVML call in collector %s has not returned for %.0f s",
                      self.device.index, self.busy_in, self.clock() - started)
            self.stats.error(self.busy_in, "timeout")

    def run(self, stop: threading.Event) -> None:
        next_at = self.clock()
        while not stop.is_set():
            try:
                self.sample_once()
            except Exception:  # a bug in one sample must not end this GPU's sampling
                log.exception("GPU %d: sample failed", self.device.index)
            next_at += self.interval
            delay = next_at - self.clock()
            if delay < 0:  # fell behind (a slow call): resynchronise instead of bursting
                next_at, delay = self.clock(), 0.0
            stop.wait(delay)


@dataclass
class Sampler:
    """All GPUs' samplers, the XID sources, the store and the counters: the exporter's core.

    `xid_kernel_log`: the kernel log read for XIDs ("" : none; the CLI's default is /dev/kmsg).
    """

    nvml: Nvml
    collectors: Iterable[str]
    interval: float = 1.0
    idle_threshold: float = 0.05
    simulated: bool = False
    proc_root: str = "/proc"
    xid_kernel_log: str = ""
    clock: Callable[[], float] = time.monotonic
    store: GpuSnapshotStore = field(default_factory=GpuSnapshotStore)
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self.collectors = list(self.collectors)
        self.devices = self.nvml.devices()
        for device in self.devices:
            device.clock = self.clock  # absent readings are re-probed on the sampler's clock
        self.driver_version, self.cuda_driver_version = self.nvml.driver_info()
        self.xid_counts = XidCounts()
        self.xid = XidWatcher(self.nvml, self.devices, self.xid_counts) if "xid" in self.collectors else None
        self.kernel_log = None
        if self.xid and self.xid_kernel_log:
            self.kernel_log = KernelLogReader(
                self.xid_kernel_log, [(device.index, device.pci_bus_id) for device in self.devices],
                report=lambda index, code, gpu_instance: self.xid_counts.add(index, code, "kernel", gpu_instance),
                on_error=lambda error: self.stats.error("xid", error))
        # NVML answers the PIDs of our PID namespace and leaves out the processes it cannot see: None
        # when the processes collector is off or /proc does not say
        self.host_pid_namespace = in_host_pid_namespace(self.proc_root) if "processes" in self.collectors else None
        if self.host_pid_namespace is False:
            log.warning("not in the host PID namespace: NVML lists only the GPU processes of this PID namespace, "
                        "no other container's (run with the host PID namespace: docker --pid=host, "
                        "Kubernetes hostPID: true)")
        options: dict[str, Any] = {"idle_threshold": self.idle_threshold, "interval": self.interval,
                                   "xid_counts": self.xid_counts, "proc_root": self.proc_root}
        on_return = self.xid.register if self.xid else (lambda device: None)
        self.gpus = [GpuSampler(device, [IdentityCollector(device, simulated=self.simulated),
                                         *(BY_NAME[name](device, **options) for name in self.collectors)],
                                self.store, self.stats, interval=self.interval, simulated=self.simulated,
                                clock=self.clock, on_return=on_return)
                     for device in self.devices]
        self.hang_after = max(3 * self.interval, 2.0)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if self.xid:
            self.xid.start()
        if self.kernel_log:
            self.kernel_log.start()
        for gpu in self.gpus:
            thread = threading.Thread(target=gpu.run, args=(self._stop,), name=f"sampler-gpu{gpu.device.index}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def ready(self) -> bool:
        """True once every GPU has been sampled, found lost, or found hanging in its first sample, and the
        kernel log (if read) has been opened at its end or found unreadable."""
        now = self.clock()
        if self.kernel_log and not self.kernel_log.settled.is_set():
            return False
        return all(gpu.samples_taken or gpu.lost or
                   (gpu.busy_since is not None and now - gpu.busy_since > self.hang_after) for gpu in self.gpus)

    def watchdog(self) -> None:
        for gpu in self.gpus:
            gpu.check_hang(self.hang_after)

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop and join every thread (samplers, XID events, kernel log) and free what NVML allocated for them.

        False if a thread is stuck in an NVML call (it is a daemon thread): NVML must not be shut
        down then.
        """
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stopped = not any(thread.is_alive() for thread in self._threads)
        if self.xid and not self.xid.stop(max(0.0, deadline - time.monotonic())):
            stopped = False
        if self.kernel_log and not self.kernel_log.stop(max(0.0, deadline - time.monotonic())):
            stopped = False
        if stopped:
            for gpu in self.gpus:
                for collector in gpu.collectors:
                    collector.close()
        return stopped

    def nvml_calls(self) -> int:
        return self.nvml.calls + sum(device.calls for device in self.devices)
