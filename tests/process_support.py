"""The processes a test started, found through /proc: to check they stopped, or to kill them all."""
from __future__ import annotations

import os
import signal
from pathlib import Path


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
