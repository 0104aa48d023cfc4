"""The local record: append-only JSON lines, the post-mortem file that survives a dead stack."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger("trainer_hook")


class Record:
    """Appends JSON lines to `path`; a write error is warned about once and counted, never raised."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.failures = 0
        self._file = None
        self._warned = False
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(path, "a", encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"cannot open the record file {str(path)!r}: {exc}") from None

    def write(self, lines: Iterable[dict[str, Any]], sync: bool = False) -> None:
        """Append `lines` and flush (fsync too when `sync`, e.g. on close)."""
        if self._file is None:
            return
        try:
            text = "".join(json.dumps(line, default=str, ensure_ascii=False) + "\n" for line in lines)
            if text:
                self._file.write(text)
            self._file.flush()
            if sync:
                os.fsync(self._file.fileno())
        except (OSError, ValueError) as exc:
            self.failures += 1
            if not self._warned:
                self._warned = True
                log.warning("cannot write the record file %s: %s; training continues", self.path, exc)

    def close(self) -> None:
        if self._file is not None:
            self.write((), sync=True)
            self._file.close()
            self._file = None
