"""The exporter process's own series: process_* read from /proc/self, and python_info.

Read as prometheus_client 0.26's ProcessCollector and PlatformCollector read them (same names, help,
values; the tests compare the two byte for byte), without importing prometheus_client.
"""
from __future__ import annotations

import os
import platform

from exporter.metrics import PROCESS_METRICS, PYTHON_INFO, MetricSpec

Samples = list[tuple[tuple[str, ...], float]]  # (label values in the spec's label order, value)
_VIRTUAL, _RESIDENT, _START, _CPU, _OPEN_FDS, _MAX_FDS = PROCESS_METRICS


class ProcessMetrics:
    """process_* of this process under `proc` (none where `proc` cannot be read), then python_info."""

    def __init__(self, proc: str = "/proc") -> None:
        self._self = os.path.join(proc, "self")
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._page_size = os.sysconf("SC_PAGE_SIZE")
        self._boot_time = _boot_time(proc)
        major, minor, patchlevel = platform.python_version_tuple()
        self._python = (platform.python_implementation(), major, minor, patchlevel, platform.python_version())

    def families(self) -> list[tuple[MetricSpec, Samples]]:
        out: list[tuple[MetricSpec, Samples]] = []
        if self._boot_time:
            try:
                with open(os.path.join(self._self, "stat"), "rb") as stat:
                    parts = stat.read().split(b")")[-1].split()
                cpu = float(parts[11]) / self._ticks + float(parts[12]) / self._ticks
                out += [(_VIRTUAL, [((), float(parts[20]))]), (_RESIDENT, [((), float(parts[21]) * self._page_size)]),
                        (_START, [((), float(parts[19]) / self._ticks + self._boot_time)]), (_CPU, [((), cpu)])]
            except (OSError, IndexError, ValueError):
                pass
            try:
                max_fds = _max_open_files(os.path.join(self._self, "limits"))
                open_fds = len(os.listdir(os.path.join(self._self, "fd")))
                out += [(_OPEN_FDS, [((), float(open_fds))]), (_MAX_FDS, [((), max_fds)])]
            except (OSError, LookupError, ValueError):
                pass
        out.append((PYTHON_INFO, [(self._python, 1.0)]))
        return out


def _boot_time(proc: str) -> float:
    """The `btime` of `proc`/stat; 0 where it cannot be read (then there are no process_* series)."""
    try:
        with open(os.path.join(proc, "stat"), "rb") as stat:
            for line in stat:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, IndexError, ValueError):
        pass
    return 0.0


def _max_open_files(path: str) -> float:
    """The soft limit on open files in a /proc/PID/limits file; LookupError when it is not there."""
    with open(path, "rb") as limits:
        for line in limits:
            if line.startswith(b"Max open file"):
                return float(line.split()[3])
    raise LookupError("no open-files limit")
