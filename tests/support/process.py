"""The processes a test started, found through /proc: to check they stopped, or to kill them all; and
what a process started as another user can reach."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import REPO


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first, then the parent), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> set[int]:
    """PIDs whose parent is `pid` (also those in sessions of their own)."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(entry.name)
        if fields is not None and int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def descendants(pid: int) -> set[int]:
    """Children, their children, and so on."""
    found, todo = set(), [pid]
    while todo:
        new = children(todo.pop()) - found
        found |= new
        todo.extend(new)
    return found


def alive(pids: set[int]) -> set[int]:
    """The PIDs in `pids` that still run (zombies count as gone)."""
    return {pid for pid in pids if (fields := _stat(pid)) is not None and fields[0] != "Z"}


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (a launcher's workers in sessions of their own,
    which a process-group kill would miss)."""
    for victim in descendants(pid) | {pid}:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def runnable_as(uid: int, *imports: str) -> str | None:
    """Why this interpreter, with the packages `imports` names, cannot run as `uid` (a checkout or
    environment under a folder only root may enter, such as a clone in /root or a `mktemp -d`), or None
    when it can."""
    done = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                           sys.executable, "-c", "".join(f"import {name};" for name in imports) or "pass"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    if done.returncode == 0:
        return None
    return (f"{sys.executable} or its packages cannot be used by uid {uid} (a checkout only root may enter): "
            f"{done.stderr.strip()[-200:]}")


@contextlib.contextmanager
def readable_copy(*packages: str) -> Iterator[Path]:
    """A copy of the repository's `packages`, in a folder every user may read, for PYTHONPATH of a process
    started as another user (the checkout itself may be private); removed on exit."""
    folder = Path(tempfile.mkdtemp(prefix="dualtrack-readable-"))
    try:
        for package in packages:
            shutil.copytree(REPO / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def default_signal_actions() -> None:
    """For `preexec_fn`: the child starts with SIGINT, SIGTERM and SIGHUP at their default actions,
    whatever the launcher of the tests ignores (`nohup` ignores SIGHUP; a background job, SIGINT)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
