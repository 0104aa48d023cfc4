"""XIDs from the kernel log: the driver's `NVRM: Xid (PCI:0000:3b:00): 79, ...` records, matched to GPUs
by PCI bus id.

NVML delivers only the XIDs it classes as critical (79, 119 and 120 never come through it), so the
driver's own log line is read too: `/dev/kmsg` by default (`--collector.xid.kernel-log`), or any file
that grows with records in the same format (the Kubernetes reader's copy, `dmesg --follow --raw`, a
test). A thread reads it, off the scrape path, and hands each XID to `XidCounts`, which counts it once
even when NVML sends the same event.

Only the kernel's own XID records count. A `/dev/kmsg` record is `PRI,SEQ,USEC,FLAGS[,...];MESSAGE`
(PRI = facility * 8 + level), a `dmesg --raw` line `<PRI>[ seconds] MESSAGE`; a line in neither form
is no record. The kernel gives its own messages facility 0 and forces facility 1 (user) on whatever
userspace writes to /dev/kmsg, and kernel messages may quote user text (`tmpfs: Unknown parameter
'NVRM: Xid ...'` from a mount option any user namespace may pass). So an XID is a facility-0 record
whose message starts with `NVRM: Xid (`; on a MIG GPU the driver adds the GPU and compute instance,
`NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:00): 13, ...`, which becomes the `gpu_instance` label.

Where reading starts: at the end. `/dev/kmsg` replays its whole ring buffer to a new reader, and a
file holds what an earlier exporter already counted, so the reader seeks to the end on open
(`SEEK_END`: after the last record for /dev/kmsg) and counts XIDs logged from its start on, as the
NVML events are. An exporter restart therefore never counts an XID again, and neither does a read
error: the reader then skips to the end of what it holds open (or, if that fails, reopens it at its
end). Only a file that is truncated or replaced (log rotation) is read again from its start: it is new.

The path is opened once with the privilege the exporter starts with (`open`, before the CLI drops it:
docs/security.md) and then held open, so reading goes on without that privilege.
A path that cannot be opened (missing, no CAP_SYSLOG under `kernel.dmesg_restrict=1`, not allowed by a
container's device cgroup, not mounted in the container) is one warning and one
`nvml_exporter_errors_total{collector="xid"}`; the reader tries again every RETRY seconds, quietly, and
the NVML events keep counting meanwhile.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

log = logging.getLogger(__name__)
DEFAULT_PATH = "/dev/kmsg"
POLL = 0.25  # seconds between two reads that found nothing new
RETRY = 30.0  # seconds between two attempts to open a path that could not be opened
READ_SIZE = 8192  # one /dev/kmsg record (at most ~1 KiB of text plus its dictionary) fits
KERNEL_FACILITY = 0  # LOG_KERN; the kernel forces LOG_USER (1) on records written from userspace
#: a /dev/kmsg record `PRI,SEQ,USEC,FLAGS[,...];` or a `dmesg --raw` line `<PRI>[ seconds] `, up to its message
RECORD = re.compile(rb"(?:(\d{1,4}),\d+,\d+,[^;]*;|<(\d{1,4})>(?:\[ *\d+\.\d+\] )?)")
XID_MESSAGE = re.compile(rb"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+(?:\.[0-7])?)"
                         rb"(?: GPU-I:(\d{1,4})(?: GPU-CI:\d{1,4})?)?\): (\d{1,9})\b")
BUS_ID = re.compile(r"(?:([0-9A-Fa-f]{1,8}):)?([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})(?:\.[0-7])?")
SYSLOG_CAPABILITIES = (34, 21)  # CAP_SYSLOG, and CAP_SYS_ADMIN (which the kernel still accepts for it)

BusKey = tuple[int, int, int]


class XidRecord(NamedTuple):
    """An XID the kernel logged: the GPU's bus key, the code and the MIG GPU instance ("" for a whole GPU)."""

    bus: BusKey
    code: int
    gpu_instance: str


def bus_key(bus_id: str) -> BusKey | None:
    """(domain, bus, device) of a PCI bus id in NVML's form (`00000000:3B:00.0`) or the kernel's
    (`0000:3b:00`); the function is left out (the kernel's XID line has none). None if unparsable."""
    match = BUS_ID.fullmatch(bus_id.strip())
    if not match:
        return None
    domain, bus, device = match.groups()
    return int(domain or "0", 16), int(bus, 16), int(device, 16)


def parse_xid(line: bytes) -> XidRecord | None:
    """The XID of a kernel record (a /dev/kmsg record or a `dmesg --raw` line), else None: a record of
    another facility than the kernel's, a message that does not start with `NVRM: Xid (`, or no record."""
    record = RECORD.match(line)
    if not record or int(record.group(1) or record.group(2)) >> 3 != KERNEL_FACILITY:
        return None
    match = XID_MESSAGE.match(line, record.end())
    if not match:
        return None
    key = bus_key(match.group(1).decode())
    instance = match.group(2)
    return None if key is None else XidRecord(key, int(match.group(3)), str(int(instance)) if instance else "")


def open_failure_hint(error: int, status: str = "/proc/self/status",
                      dmesg_restrict: str = "/proc/sys/kernel/dmesg_restrict") -> str:
    """What to do about a kernel log that could not be opened with `error` (an errno).

    The kernel answers EPERM both without CAP_SYSLOG (under kernel.dmesg_restrict=1) and when a
    container's device cgroup does not allow /dev/kmsg (c 1:11), whatever the capabilities. A process
    that holds CAP_SYSLOG (or where dmesg_restrict is 0) was refused by the device cgroup.
    """
    if error == errno.EPERM and _syslog_allowed(status, dmesg_restrict):
        return ("EPERM: the device cgroup does not allow /dev/kmsg (c 1:11), whatever the capabilities: a "
                "container needs it on its device allowlist (docker --device /dev/kmsg:/dev/kmsg:r; on "
                "Kubernetes, the kernel-log component's privileged reader: see docs/kubernetes.md)")
    if error in (errno.EPERM, errno.EACCES):
        return ("the exporter needs CAP_SYSLOG to read /dev/kmsg under kernel.dmesg_restrict=1 and, in a "
                "container, /dev/kmsg on its device allowlist (see docs/security.md)")
    return "the exporter needs CAP_SYSLOG and /dev/kmsg (see docs/metrics.md)"


def _syslog_allowed(status: str, dmesg_restrict: str) -> bool:
    """True if opening /dev/kmsg passes the kernel's syslog check: dmesg_restrict is 0, or the process's
    effective capabilities hold CAP_SYSLOG (or CAP_SYS_ADMIN)."""
    try:
        with open(dmesg_restrict) as handle:
            if handle.read().strip() == "0":
                return True
        with open(status) as handle:
            effective = next(int(line.split()[1], 16) for line in handle if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    return any(effective >> capability & 1 for capability in SYSLOG_CAPABILITIES)


class KernelLogReader:
    """Follows `path` in a thread and reports each XID record of a known GPU as
    `report(gpu index, code, gpu_instance)`."""

    def __init__(self, path: str, gpus: Iterable[tuple[int, str]], report: Callable[[int, int, str], object],
                 on_error: Callable[[str], None]) -> None:
        self.path = path
        self.report = report
        self.on_error = on_error  # called once per failure to open, with a short error name
        self.gpus = {key: index for index, bus_id in gpus if (key := bus_key(bus_id)) is not None}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._warned = False
        self._pending = b""  # a line not yet complete (a file written in pieces)
        self.settled = threading.Event()  # set once the path was opened (at its end) or found unreadable

    def open(self) -> bool:
        """Open the path at its end now, with the privilege the process holds now (the CLI calls this before
        dropping it); False (one warning, one error) if it cannot be opened: the thread then tries again."""
        return self._fd is not None or self._open(at_end=True)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="xid-kernel-log", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop and join the thread (it never blocks in a read), then close the file; False if it is still running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        running = self._thread is not None and self._thread.is_alive()
        if not running:
            self._close()
        return not running

    def _open(self, at_end: bool) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self._failed(exc)
            return False
        try:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            if at_end:
                os.lseek(fd, 0, os.SEEK_END)
        except OSError as exc:
            os.close(fd)
            self._failed(exc)
            return False
        self._fd, self._pending = fd, b""
        if self._warned:
            log.warning("reading XIDs from %s again", self.path)
            self._warned = False
        self.settled.set()
        return True

    def _failed(self, exc: OSError) -> None:
        if self._warned:
            return
        self._warned = True
        name = errno.errorcode.get(exc.errno or 0, "error").lower()
        log.warning("cannot read the kernel log %s (%s): XIDs that NVML does not deliver (79, 119, 120 among "
                    "them) are not counted; %s, or --collector.xid.kernel-log= to turn this off; trying again "
                    "every %.0f s", self.path, exc.strerror or exc, open_failure_hint(exc.errno or 0), RETRY)
        self.on_error(f"kernel_log_{name}")
        self.settled.set()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _run(self) -> None:
        at_end = True  # every open skips what is there, but that of a rotated file, which is new
        while not self._stop.is_set():
            if self._fd is None:
                if not self._open(at_end):
                    self._stop.wait(RETRY)
                    continue
                at_end = True
            fd = self._fd
            assert fd is not None  # opened just above
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:  # /dev/kmsg: no new record
                data = b""
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # /dev/kmsg: records overwritten before we read them
                    log.debug("kernel log %s: records were lost in the ring buffer", self.path)
                    continue
                log.debug("kernel log %s: %s; going on from its end", self.path, exc)
                self._skip_to_end()
                self._stop.wait(POLL)
                continue
            if data:
                self._lines(data)
            elif self._replaced():
                at_end = False
            else:
                self._stop.wait(POLL)

    def _skip_to_end(self) -> None:
        """After a read error: go on from the end of what is open (the privilege it was opened with may be
        gone), never from its start (the ring buffer's XIDs were counted); if that fails, reopen it at its end."""
        try:
            if self._fd is not None:
                os.lseek(self._fd, 0, os.SEEK_END)
        except OSError:
            self._close()
        self._pending = b""

    def _lines(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            found = parse_xid(line)
            if found is not None:
                self._xid(line, found)

    def _xid(self, line: bytes, found: XidRecord) -> None:
        """Report one XID record of a known GPU (exporter.kernellog_copy copies it instead)."""
        index = self.gpus.get(found.bus)
        if index is None:
            log.debug("kernel log: XID %d on a bus id no exported GPU has: %s", found.code, found.bus)
        else:
            self.report(index, found.code, found.gpu_instance)

    def _replaced(self) -> bool:
        """True (and the file closed, to be reopened from its start) if a regular file was truncated or
        replaced at its path; a character device (/dev/kmsg) never is."""
        if self._fd is None:
            return False
        fd = self._fd
        mode = os.fstat(fd)
        if not stat.S_ISREG(mode.st_mode):
            return False
        try:
            current = os.stat(self.path)
        except OSError:
            return False  # removed: keep reading the old one until a new one appears
        if current.st_ino != mode.st_ino or mode.st_size < os.lseek(fd, 0, os.SEEK_CUR):
            self._close()
            return True
        return False
