"""The replay's temporary folder inside --out: removed on exit and on SIGINT/SIGTERM/SIGHUP, and,
after a SIGKILL or a power cut, by a later replay that can prove it stale.

Each folder, `.dualtrack-replay-<random>`, holds OWNER_FILE naming the process that made it (host,
boot, pid and the pid's start time). A later replay removes such a folder only when that process
is gone: same host, and another boot or a pid that no longer runs (or now runs another program).
A folder without a readable owner file, or of another host, is never touched.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PREFIX = ".dualtrack-replay-"
OWNER_FILE = "dualtrack-replay-owner.json"
_MAX_OWNER_BYTES = 4096
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like KeyboardInterrupt, so every cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def owner(pid: int | None = None) -> dict[str, Any]:
    """What identifies process `pid` (default: this one) on this machine, for OWNER_FILE."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pid": pid, "started": _started(pid)}


@contextlib.contextmanager
def workspace(out: Path) -> Iterator[Path]:
    """A fresh temporary folder in `out`, marked as this process's; removed however the block ends.

    SIGTERM and SIGHUP raise Interrupted in the main thread meanwhile (SIGINT already raises
    KeyboardInterrupt), so the folder is removed on those too.
    """
    with _signals_raise():
        work = Path(tempfile.mkdtemp(prefix=PREFIX, dir=out))
        try:
            (work / OWNER_FILE).write_text(json.dumps(owner()) + "\n")
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)


def remove_stale(out: Path) -> int:
    """Remove the temporary folders in `out` whose owner file proves their process gone; how many."""
    removed = 0
    for path in out.glob(PREFIX + "*"):
        if _stale(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _stale(path: Path) -> bool:
    try:
        if not stat.S_ISDIR(path.lstat().st_mode):
            return False
        fd = os.open(path / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return False
            recorded = json.loads(handle.read(_MAX_OWNER_BYTES))
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(recorded, dict) or type(recorded.get("pid")) is not int or recorded["pid"] <= 0:
        return False
    here = owner(recorded["pid"])
    if recorded.get("host") != here["host"]:
        return False
    if recorded.get("boot") and here["boot"] and recorded["boot"] != here["boot"]:
        return True
    started = recorded.get("started")
    if here["started"] is None or type(started) is not int:
        return not _running(recorded["pid"])
    return started != here["started"]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, someone else's
    return True


def _started(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat), None if unknown."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    try:
        return int(text.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read(_MAX_OWNER_BYTES).strip()
    except OSError:
        return None


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in _SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
