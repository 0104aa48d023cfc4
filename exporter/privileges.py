"""Dropping root: `--run-as=UID[:GID]` makes an exporter started as root serve as that user.

The CLI opens what needs privilege first (the kernel log, the listening socket), then calls `drop`
before the first connection is accepted and before any sampler thread starts. `drop` clears the
supplementary groups, sets the group and the user (real, effective and saved), which clears every
capability (permitted, effective, ambient) of every thread, sets no_new_privs so that no exec can
gain one back, and then checks all of it in /proc/self/task/*/status: a process that asked to run
as a user never goes on as root. (Everything it needs is imported before: after the drop, the
interpreter may no longer read its own library, as with a Python installed under a 0700 /root.)
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

PR_SET_NO_NEW_PRIVS = 38
CAPABILITY_VERSION_3 = 0x20080522  # linux/capability.h: two 32-bit words per set
#: what no thread may keep; CapInh is cleared too (older runtimes give privileged containers a full
#: inheritable set) but not required: with no_new_privs no exec can turn it into a capability
CHECKED = ("Uid", "Gid", "CapPrm", "CapEff", "CapAmb")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class PrivilegeError(Exception):
    """The process could not become the user it was asked to run as (one line)."""


def parse_run_as(text: str) -> tuple[int, int] | None:
    """`UID[:GID]` (numbers; GID defaults to UID) as (uid, gid); "" is None (stay as started). ValueError."""
    if not text:
        return None
    uid_text, _, gid_text = text.partition(":")
    try:
        uid, gid = int(uid_text), int(gid_text or uid_text)
    except ValueError:
        raise ValueError(f"{text!r} is not UID[:GID] (numbers)") from None
    if uid <= 0 or gid <= 0:
        raise ValueError(f"{text!r}: the user and group must not be root (0) or negative")
    return uid, gid


def drop(uid: int, gid: int, proc: str = "/proc/self") -> None:
    """Become `uid`:`gid` with no supplementary group and no capability, in every thread; raises
    PrivilegeError. A process already running as exactly that user (the image's default) keeps the
    groups its runtime gave it and passes if it holds no capability."""
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid or os.getegid() != gid:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        except OSError as exc:
            raise PrivilegeError(f"cannot switch to uid {uid}, gid {gid}: {exc.strerror or exc} "
                                 "(it takes root with CAP_SETUID and CAP_SETGID)") from None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), (_CapData * 2)())  # all three sets empty
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise PrivilegeError(f"cannot set no_new_privs: {os.strerror(ctypes.get_errno())}")
    left = leftovers(uid, gid, proc)
    if left:
        raise PrivilegeError(f"still privileged after switching to uid {uid}, gid {gid}: {'; '.join(left)}")


def leftovers(uid: int, gid: int, proc: str = "/proc/self") -> list[str]:
    """What in any thread of `proc` is not `uid`:`gid` without capabilities ([] when nothing)."""
    problems = []
    for status in sorted(Path(proc, "task").glob("*/status")):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue  # a thread that ended meanwhile
        thread = status.parent.name
        wanted = {"Uid": {str(uid)}, "Gid": {str(gid)}}
        for name in CHECKED:
            values = set(fields.get(name, "").split())
            if name in wanted and values != wanted[name]:
                problems.append(f"thread {thread} {name} {' '.join(fields[name].split())}")
            elif name.startswith("Cap") and any(int(value, 16) for value in values):
                problems.append(f"thread {thread} {name} {' '.join(values)}")
    return problems
