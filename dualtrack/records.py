"""Reading local records (the hook's JSON-lines files) one line at a time, whatever their state.

Shared by `dualtrack replay` and `dualtrack report`. Accepts format 1 (lines without "format")
and format 2, rotated files (<stem>.<n>.jsonl before <stem>.jsonl), and counts what it skips:
a truncated last line, corrupt lines, lines before any start line, runs mixed in one file, empty
files. Nothing here keeps more than one line and the per-run identity in memory.
"""
from __future__ import annotations

import functools
import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from trainer_hook.contract import FORMAT_VERSION, Dropped, metric_suffix

#: The newest record format this reader knows: the one the hook of this version writes.
KNOWN_FORMAT = FORMAT_VERSION
_ROTATED = re.compile(r"^(?P<stem>.+)\.(?P<n>\d+)\.jsonl$")
#: Problem kinds whose plural is not the kind plus "s".
_PLURALS = {"run mixed into another run's file": "runs mixed into another run's file",
            "step line before any start line": "step lines before any start line",
            "end line before any start line": "end lines before any start line"}
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "+inf": math.inf}


class InputError(Exception):
    """An input path that cannot be used (missing, not a record): one line for the user."""


@dataclass
class Run:
    """One rank of one run, as its start line (and end line, once read) describe it."""

    job: str
    run: str
    rank: str
    instance: str
    start_time: float | None
    format: int
    start: dict[str, Any]
    end: dict[str, Any] | None = None
    steps: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.job, self.run, self.rank)

    @property
    def name(self) -> str:
        return f"{self.job}/{self.run}/rank{self.rank}"

    @property
    def config(self) -> dict[str, str]:
        config = self.start.get("config")
        return {str(k): str(v) for k, v in config.items()} if isinstance(config, dict) else {}


@dataclass
class Problems:
    """What the reader skipped, counted by kind, with the first place each kind was seen."""

    counts: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)
    files: int = 0
    newer_format: int = 0

    def add(self, kind: str, where: str) -> None:
        self.counts[kind] += 1
        self.first.setdefault(kind, where)

    def summary(self) -> str:
        """'2 corrupt lines (first at a.jsonl:17), 1 truncated last line (...)' or ''."""
        parts = [f"{count} {kind if count == 1 else _PLURALS.get(kind, kind + 's')} (first at {self.first[kind]})"
                 for kind, count in sorted(self.counts.items())]
        if self.newer_format:
            parts.append(f"{self.newer_format} start line(s) of a format newer than {KNOWN_FORMAT} "
                         f"(read as {KNOWN_FORMAT}; upgrade dualtrack)")
        return ", ".join(parts)


def expand(paths: Iterable[str | Path]) -> list[Path]:
    """Files to read, in order: a directory gives its *.jsonl; rotated parts come oldest first.

    Raises InputError for a path that does not exist or a directory without records.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise InputError(f"{path}: directory holds no *.jsonl record")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"{path}: no such record file or directory")
    unique = list(dict.fromkeys(p.resolve() for p in files))
    return sorted(unique, key=_rotation_order)


def _rotation_order(path: Path) -> tuple[str, str, float]:
    match = _ROTATED.match(path.name)
    if match:
        return (str(path.parent), match["stem"], int(match["n"]))
    return (str(path.parent), path.stem, math.inf)


@functools.lru_cache(maxsize=4096)
def exported_name(key: str) -> str | None:
    """The suffix the live hook exports a logged key as ("train/loss" -> "loss"); None: not exported."""
    made = metric_suffix(key)
    return None if isinstance(made, Dropped) else made


def number(value: Any) -> float | None:
    """A record number: int/float, or the strings "nan", "inf", "-inf"; None otherwise."""
    if type(value) in (float, int):
        return float(value)
    if isinstance(value, str):
        return _NONFINITE.get(value.lower())
    return None


class Reader:
    """Iterates (run, line) over record files: step lines, then the end line of each run.

    Step lines are dicts as written, with "step" an int and "time" a float; "values" holds only
    readable numbers (floats, NaN/Inf included); "nonfinite" lists the keys that make the step
    non-finite (not an overflow of a skipped step), as the live hook counts them. `problems` and `runs` fill in as it goes.
    """

    def __init__(self, paths: Iterable[str | Path]) -> None:
        self.files = expand(paths)
        self.problems = Problems(files=len(self.files))
        self.runs: dict[tuple[str, str, str], Run] = {}

    def no_steps(self) -> str:
        """Why there is nothing to show: '<files> hold no step line (<what was skipped>)'."""
        skipped = self.problems.summary()
        return (f"no step lines in {', '.join(str(f) for f in self.files)}"
                + (f" ({skipped})" if skipped else ""))

    def print_skipped(self, command: str) -> None:
        """One line on stderr with what was skipped, if anything."""
        skipped = self.problems.summary()
        if skipped:
            print(f"dualtrack {command}: skipped {skipped}", file=sys.stderr)

    def __iter__(self) -> Iterator[tuple[Run, dict[str, Any]]]:
        for path in self.files:
            yield from self._read_file(path)

    def _read_file(self, path: Path) -> Iterator[tuple[Run, dict[str, Any]]]:
        current: Run | None = None
        seen_in_file: set[tuple[str, str, str]] = set()
        try:
            handle = open(path, "rb")
        except OSError as exc:
            self.problems.add("unreadable file", f"{path.name}: {exc.strerror}")
            return
        with handle:
            number_ = 0
            for number_, raw in enumerate(handle, 1):
                where = f"{path.name}:{number_}"
                line = _parse(raw)
                if line is None:
                    if raw.strip():
                        last = not raw.endswith(b"\n")
                        self.problems.add("truncated last line" if last else "corrupt line", where)
                    continue
                event = line.get("event")
                if event == "start":
                    run = self._start(line, where)
                    if run is None:
                        continue
                    if seen_in_file and run.key not in seen_in_file:
                        self.problems.add("run mixed into another run's file", where)
                    seen_in_file.add(run.key)
                    current = run
                elif event is None:
                    step = _step_line(line)
                    if step is None:
                        self.problems.add("corrupt line", where)
                    elif current is None:
                        self.problems.add("step line before any start line", where)
                    else:
                        current.steps += 1
                        yield current, step
                elif event == "end":
                    if current is None:
                        self.problems.add("end line before any start line", where)
                    elif isinstance(line.get("time"), (int, float)):
                        current.end = line
                        yield current, line
                    else:
                        self.problems.add("corrupt line", where)
            if number_ == 0:
                self.problems.add("empty file", path.name)

    def _start(self, line: dict[str, Any], where: str) -> Run | None:
        try:
            job, run, rank = (str(line[k]) for k in ("job", "run", "rank"))
        except KeyError:
            self.problems.add("corrupt line", where)
            return None
        version = line.get("format", 1)
        if isinstance(version, int) and version > KNOWN_FORMAT and (job, run, rank) not in self.runs:
            self.problems.newer_format += 1
        known = self.runs.get((job, run, rank))
        if known is not None:
            return known
        start_time = line.get("time")
        made = Run(job=job, run=run, rank=rank, instance=str(line.get("instance", "")),
                   start_time=float(start_time) if isinstance(start_time, (int, float)) else None,
                   format=version if isinstance(version, int) else 1, start=line)
        self.runs[made.key] = made
        return made


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        line = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    return line if isinstance(line, dict) else None


def _step_line(line: dict[str, Any]) -> dict[str, Any] | None:
    """The line with its numbers checked, or None when step/time/values are unusable."""
    step, time = line.get("step"), line.get("time")
    values = line.get("values", {})
    if type(step) is not int or type(time) not in (int, float) or not isinstance(values, dict):
        return None
    line["time"] = float(time)
    line["values"] = values = {str(k): v for k, v in ((k, number(v)) for k, v in values.items()) if v is not None}
    # The step's non-finite keys as the live hook counts them: every NaN/Inf value, except on a step
    # the GradScaler skipped, where only the keys the hook listed count (an overflow is not a divergence).
    listed = line.get("nonfinite")
    listed = {str(k) for k in listed} if isinstance(listed, list) else set()
    skipped = bool(line.get("skipped"))
    line["nonfinite"] = [k for k, v in values.items() if not math.isfinite(v) and (not skipped or k in listed)]
    return line
