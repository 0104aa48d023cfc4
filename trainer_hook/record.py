"""The local record: append-only JSON lines, the post-mortem file that survives a dead stack.

Format and rotation: docs/postmortem.md ("The record"). Where others may plant links, the record
writes through none: its folder must be this user's and not writable by others (unless sticky; its
group may write where the group is the user's private one), or is created 0700; the file is opened
with O_NOFOLLOW and must be a regular file of this user, or is created with O_EXCL and mode 0600;
every name is resolved relative to the folder opened once, and rotation writes a fresh file created
with O_EXCL under a random name before renaming it into place.
Anything else: one warning, no record (counted in training_record_failures_total), training goes on.
"""
from __future__ import annotations

import errno
import grp
import json
import logging
import os
import pwd
import re
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from .contract import FORMAT_VERSION

log = logging.getLogger("trainer_hook")

#: Default size at which the record file is rotated (TrainingMonitor(record_max_bytes=...)).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
#: Smallest accepted rotation size: a file must hold at least its start line and a few steps.
MIN_MAX_BYTES = 4096


def rotated_path(path: Path, number: int) -> Path:
    """<stem>.<number>.jsonl next to `path` (<stem>.jsonl): the number-th full file, oldest first."""
    return path.with_name(f"{path.stem}.{number}{path.suffix}")


def rotated_numbers(path: Path, folder: int) -> list[int]:
    """The numbers of the rotated files of `path` that exist in `folder` (an open descriptor of its
    folder), in ascending order."""
    pattern = re.compile(re.escape(path.stem) + r"\.(\d+)" + re.escape(path.suffix) + "$")
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)


class Unsafe(Exception):
    """Why the record is not written where it was asked to be: one line."""


def _open_folder(folder: Path) -> int:
    """A descriptor of `folder` (created 0700 if missing) if it is safe to write in, else Unsafe."""
    try:
        folder.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        pass
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    info = os.fstat(fd)
    problem = None
    if info.st_uid != os.geteuid():
        problem = f"the folder belongs to uid {info.st_uid}, not to this process (uid {os.geteuid()})"
    elif (info.st_mode & stat.S_IWOTH or info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid)) \
            and not info.st_mode & stat.S_ISVTX:
        problem = f"the folder is writable by others (mode {stat.S_IMODE(info.st_mode):o}, not sticky)"
    if problem:
        os.close(fd)
        raise Unsafe(problem)
    return fd


def _private_group(gid: int) -> bool:
    """Whether `gid` is this user's private group (umask 002 systems give each user one): the user's
    primary group, named after the user, with no other member. Its write bit lets in no one else."""
    try:
        user = pwd.getpwuid(os.geteuid())
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def _open_file(name: str, folder: int) -> int:
    """`name` in `folder` for appending: an existing regular file of this user with one link, never
    through a link, or a new one (O_EXCL, 0600)."""
    flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=folder)
    except FileNotFoundError:
        return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=folder)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise Unsafe("the file is a symbolic link") from None
        raise
    info = os.fstat(fd)
    problem = ("not a regular file" if not stat.S_ISREG(info.st_mode) else
               f"the file belongs to uid {info.st_uid}" if info.st_uid != os.geteuid() else
               "the file has other hard links" if info.st_nlink != 1 else None)
    if problem:
        os.close(fd)
        raise Unsafe(problem)
    os.set_blocking(fd, True)
    return fd


class Record:
    """Appends JSON lines to `path`; a write error is warned about once and counted, never raised.

    With `max_bytes`, a file about to grow past it is renamed to <stem>.<n>.jsonl and a new
    <stem>.jsonl starts with the run's start line marked "continued": nothing is lost, every file
    reads on its own. Lines are written whole (one write per batch), so a crash leaves at most one
    truncated last line; reopening such a file cuts that partial line off first.
    """

    def __init__(self, path: Path | None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < MIN_MAX_BYTES):
            raise ValueError(f"record_max_bytes must be an int >= {MIN_MAX_BYTES} (or None: never "
                             f"rotate), got {max_bytes!r}")
        self.path = path
        self.max_bytes = max_bytes
        self.failures = 0
        self._file: BinaryIO | None = None
        self._size = 0
        self._header = 0  # bytes of the continued start line a rotation put at the top of the file
        self._start: dict[str, Any] | None = None  # repeated at the top of each rotated-in file
        self._warned = False
        self._folder: int | None = None  # descriptor of the record's folder: names resolve in it
        if path is not None:
            try:
                self._folder = _open_folder(path.parent)
                self._file = os.fdopen(_open_file(path.name, self._folder), "ab")
                self._size = os.fstat(self._file.fileno()).st_size
                if self._size:
                    self._cut_partial_line(self._file)
            except (OSError, Unsafe) as exc:
                self.close()
                self.failures += 1
                self._warned = True
                reason = exc if isinstance(exc, Unsafe) else (exc.strerror or exc)
                log.warning("no local record: %s: %s; training continues", path, reason)

    def _cut_partial_line(self, file: BinaryIO) -> None:
        """A previous writer that crashed mid-line left a tail without a newline: drop it."""
        start = max(0, self._size - 65536)
        tail = os.pread(file.fileno(), self._size - start, start)
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n")
        keep = start + cut + 1 if cut >= 0 else (0 if start == 0 else self._size)
        if keep != self._size:
            file.truncate(keep)
            self._size = keep

    def write(self, lines: Iterable[dict[str, Any]], sync: bool = False) -> None:
        """Append `lines` and flush (fsync too when `sync`, e.g. on close)."""
        if self._file is None:
            return
        try:
            chunk: list[bytes] = []
            size = 0
            for line in lines:
                if line.get("event") == "start":
                    line = {"event": "start", "format": FORMAT_VERSION, **line}
                    if self._start is None:
                        self._start = line
                data = (json.dumps(line, default=str, ensure_ascii=False) + "\n").encode("utf-8")
                if self.max_bytes and self._size + size + len(data) > self.max_bytes \
                        and self._size + size > self._header:  # a line longer than the limit: alone
                    self._append(chunk)
                    chunk, size = [], 0
                    self._rotate()
                chunk.append(data)
                size += len(data)
            self._append(chunk)
            if sync:
                os.fsync(self._current().fileno())
        except (OSError, ValueError) as exc:
            self.failures += 1
            if not self._warned:
                self._warned = True
                log.warning("cannot write the record file %s: %s; training continues", self.path, exc)

    def _append(self, chunk: list[bytes]) -> None:
        file = self._current()
        if chunk:
            data = b"".join(chunk)
            file.write(data)
            self._size += len(data)
        file.flush()

    def _current(self) -> BinaryIO:
        """The file being written; only called while it is open (write() returns early otherwise)."""
        assert self._file is not None
        return self._file

    def _rotate(self) -> None:
        """Rename the full file to the next <stem>.<n>.jsonl and continue in a fresh <stem>.jsonl.

        The fresh file gets its start line before it takes the name, so that a crash at any point
        leaves no empty or headless <stem>.jsonl (at worst a <stem>.jsonl.<random>.tmp with the start
        line). It is created with O_EXCL under a random name: nothing planted is written through.
        """
        file, path, folder = self._current(), self.path, self._folder
        assert path is not None and folder is not None  # an open file has both
        os.fsync(file.fileno())
        file.close()
        self._file = None
        header = b"" if self._start is None else (json.dumps(
            {**self._start, "continued": True}, default=str, ensure_ascii=False) + "\n").encode("utf-8")
        fresh = f"{path.name}.{secrets.token_hex(8)}.tmp"
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        handle = os.fdopen(os.open(fresh, flags, 0o600, dir_fd=folder), "ab")
        handle.write(header)
        handle.flush()
        numbers = rotated_numbers(path, folder)
        os.replace(path.name, rotated_path(path, numbers[-1] + 1 if numbers else 1).name,
                   src_dir_fd=folder, dst_dir_fd=folder)
        os.replace(fresh, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        self._file = handle
        self._size = self._header = len(header)

    def close(self) -> None:
        if self._file is not None:
            self.write((), sync=True)
            self._file.close()
            self._file = None
        if self._folder is not None:
            os.close(self._folder)
            self._folder = None
