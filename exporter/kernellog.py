"""XIDs from the kernel log: `NVRM: Xid (PCI:0000:3b:00): 79, ...` lines, matched to GPUs by PCI bus id.

NVML delivers only the XIDs it classes as critical (79, 119 and 120 never come through it), so the
driver's own log line is read too: `/dev/kmsg` by default (`--collector.xid.kernel-log`), or any file
that grows (a `dmesg --follow` capture, a test). A thread reads it, off the scrape path, and hands
each XID to `XidCounts`, which counts it once even when NVML sends the same event.

Where reading starts: at the end. `/dev/kmsg` replays its whole ring buffer to a new reader, and a
file holds what an earlier exporter already counted, so the reader seeks to the end on open
(`SEEK_END`: after the last record for /dev/kmsg) and counts XIDs logged from its start on, as the
NVML events are. An exporter restart therefore never counts an XID again. A file that is truncated
or replaced (log rotation) is read again from its start.

A path that cannot be opened (missing, no CAP_SYSLOG under `kernel.dmesg_restrict=1`, not mounted in
the container) is one warning and one `nvml_exporter_errors_total{collector="xid"}`; the reader tries
again every RETRY seconds, quietly, and the NVML events keep counting meanwhile.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from typing import Callable, Iterable

log = logging.getLogger(__name__)
DEFAULT_PATH = "/dev/kmsg"
POLL = 0.25  # seconds between two reads that found nothing new
RETRY = 30.0  # seconds between two attempts to open a path that could not be opened
READ_SIZE = 8192  # one /dev/kmsg record (at most ~1 KiB of text plus its dictionary) fits
XID_LINE = re.compile(rb"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+(?:\.[0-7])?)\): (\d+)")
BUS_ID = re.compile(r"(?:([0-9A-Fa-f]{1,8}):)?([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})(?:\.[0-7])?")

BusKey = tuple[int, int, int]


def bus_key(bus_id: str) -> BusKey | None:
    """(domain, bus, device) of a PCI bus id in NVML's form (`00000000:3B:00.0`) or the kernel's
    (`0000:3b:00`); the function is left out (the kernel's XID line has none). None if unparsable."""
    match = BUS_ID.fullmatch(bus_id.strip())
    if not match:
        return None
    domain, bus, device = match.groups()
    return int(domain or "0", 16), int(bus, 16), int(device, 16)


def parse_xid(line: bytes) -> tuple[BusKey, int] | None:
    """(bus key, XID code) of a kernel log line or /dev/kmsg record reporting an XID, else None."""
    match = XID_LINE.search(line)
    if not match:
        return None
    key = bus_key(match.group(1).decode())
    return None if key is None else (key, int(match.group(2)))


class KernelLogReader:
    """Follows `path` in a thread and reports each XID line of a known GPU as `report(gpu index, code)`."""

    def __init__(self, path: str, gpus: Iterable[tuple[int, str]], report: Callable[[int, int], None],
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

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="xid-kernel-log", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop and join the thread (it never blocks in a read), then close the file; False if it is still running."""
        self._stop.set()
        running = self._thread is not None and (self._thread.join(timeout) or self._thread.is_alive())
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
                    "them) are not counted; the exporter needs CAP_SYSLOG and /dev/kmsg (see docs/metrics.md), "
                    "or --collector.xid.kernel-log= to turn this off; trying again every %.0f s",
                    self.path, exc.strerror or exc, RETRY)
        self.on_error(f"kernel_log_{name}")
        self.settled.set()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _run(self) -> None:
        at_end = True  # only the first open skips what is there: a reopened (rotated) file is new
        while not self._stop.is_set():
            if self._fd is None:
                if not self._open(at_end):
                    self._stop.wait(RETRY)
                    continue
                at_end = False
            try:
                data = os.read(self._fd, READ_SIZE)
            except BlockingIOError:  # /dev/kmsg: no new record
                data = b""
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # /dev/kmsg: records overwritten before we read them
                    log.debug("kernel log %s: records were lost in the ring buffer", self.path)
                    continue
                log.debug("kernel log %s: %s; reopening", self.path, exc)
                self._close()
                self._stop.wait(POLL)
                continue
            if data:
                self._lines(data)
            elif not self._replaced():
                self._stop.wait(POLL)

    def _lines(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            found = parse_xid(line)
            if found is None:
                continue
            key, code = found
            index = self.gpus.get(key)
            if index is None:
                log.debug("kernel log: XID %d on a bus id no exported GPU has: %s", code, key)
            else:
                self.report(index, code)

    def _replaced(self) -> bool:
        """True (and the file closed, to be reopened from its start) if a regular file was truncated or
        replaced at its path; a character device (/dev/kmsg) never is."""
        mode = os.fstat(self._fd)
        if not stat.S_ISREG(mode.st_mode):
            return False
        try:
            current = os.stat(self.path)
        except OSError:
            return False  # removed: keep reading the old one until a new one appears
        if current.st_ino != mode.st_ino or mode.st_size < os.lseek(self._fd, 0, os.SEEK_CUR):
            self._close()
            return True
        return False
