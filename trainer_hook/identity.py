"""This process as the exporter's per-process series name it: its PID namespace and its start time.

Torch-free, so that a process can report them without loading the hook's dependencies.
"""
from __future__ import annotations

import os


def own_pid_namespace() -> str:
    """The inode (decimal) of this process's PID namespace, "" where /proc does not say. With
    os.getpid() it names this process as the exporter's per-process series do, in a container too."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""
    inode = link.removeprefix("pid:[").removesuffix("]")
    return inode if inode.isdigit() else ""


def own_start_time() -> str:
    """When this process started, in clock ticks since boot (field 22 of /proc/self/stat), "" where /proc
    does not say: the number the exporter reads in /proc/<pid>/stat, in every PID namespace. With
    os.getpid() it names this process to an exporter that may not read its PID namespace."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()  # the name before it may hold anything
    except OSError:
        return ""
    return fields[19].decode() if len(fields) > 19 and fields[19].isdigit() else ""
