"""The local record: append-only JSON lines, the post-mortem file that survives a dead stack.

Format and rotation: docs/postmortem.md ("The record").
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO, Iterable

from .contract import FORMAT_VERSION

log = logging.getLogger("trainer_hook")

#: Default size at which the record file is rotated (TrainingMonitor(record_max_bytes=...)).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
#: Smallest accepted rotation size: a file must hold at least its start line and a few steps.
MIN_MAX_BYTES = 4096


def rotated_path(path: Path, number: int) -> Path:
    """<stem>.<number>.jsonl next to `path` (<stem>.jsonl): the number-th full file, oldest first."""
    return path.with_name(f"{path.stem}.{number}{path.suffix}")


def rotated_numbers(path: Path) -> list[int]:
    """The numbers of the rotated files of `path` that exist, in ascending order."""
    pattern = re.compile(re.escape(path.stem) + r"\.(\d+)" + re.escape(path.suffix) + "$")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)


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
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._open()
            except OSError as exc:
                raise ValueError(f"cannot open the record file {str(path)!r}: {exc}") from None

    def _open(self) -> None:
        self._file = open(self.path, "ab")
        if not stat.S_ISREG(os.fstat(self._file.fileno()).st_mode):
            self.max_bytes = None  # a pipe or a terminal: nothing to cut, nothing to rotate
            return
        self._size = self._file.tell()
        if self._size:
            self._cut_partial_line()

    def _cut_partial_line(self) -> None:
        """A previous writer that crashed mid-line left a tail without a newline: drop it."""
        with open(self.path, "rb") as existing:
            start = max(0, self._size - 65536)
            existing.seek(start)
            tail = existing.read()
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n")
        keep = start + cut + 1 if cut >= 0 else (0 if start == 0 else self._size)
        if keep != self._size:
            self._file.truncate(keep)
            self._file.seek(keep)
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
                os.fsync(self._file.fileno())
        except (OSError, ValueError) as exc:
            self.failures += 1
            if not self._warned:
                self._warned = True
                log.warning("cannot write the record file %s: %s; training continues", self.path, exc)

    def _append(self, chunk: list[bytes]) -> None:
        if chunk:
            data = b"".join(chunk)
            self._file.write(data)
            self._size += len(data)
        self._file.flush()

    def _rotate(self) -> None:
        """Rename the full file to the next <stem>.<n>.jsonl and continue in a fresh <stem>.jsonl.

        The fresh file gets its start line before it takes the name, so that a crash at any point
        leaves no empty or headless <stem>.jsonl (at worst a <stem>.jsonl.tmp with the start line).
        """
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        header = b"" if self._start is None else (json.dumps(
            {**self._start, "continued": True}, default=str, ensure_ascii=False) + "\n").encode("utf-8")
        fresh = self.path.with_name(self.path.name + ".tmp")
        handle = open(fresh, "wb")
        handle.write(header)
        handle.flush()
        numbers = rotated_numbers(self.path)
        os.replace(self.path, rotated_path(self.path, numbers[-1] + 1 if numbers else 1))
        os.replace(fresh, self.path)
        self._file = handle
        self._size = self._header = len(header)

    def close(self) -> None:
        if self._file is not None:
            self.write((), sync=True)
            self._file.close()
            self._file = None
