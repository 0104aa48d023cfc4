"""Reading local records (the hook's JSON-lines files) one line at a time, whatever their state.

Shared by `dualtrack replay` and `dualtrack report`. Accepts format 1 (lines without "format")
and format 2, rotated files (<stem>.<n>.jsonl before <stem>.jsonl), and counts what it skips:
a truncated last line, corrupt lines, lines before any start line, runs mixed in one file, empty
files. Nothing here keeps more than one line and the per-run identity in memory.

Records come from anyone, so nothing in one is trusted: only regular files are read (a FIFO or a
device named *.jsonl is skipped, never opened for blocking reads), a line is read at most
MAX_LINE_BYTES at a time, JSON nested deeper than MAX_DEPTH is corrupt, lone surrogates become
U+FFFD, and a line's time must be finite, not before its run's start and not in the future (each
with CLOCK_SLACK_SECONDS of slack): a far-future time would make a TSDB block that expires every
older one.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
import sys
import time as clock
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from trainer_hook.contract import FORMAT_VERSION, Dropped, config_labels, is_overflow, label_value, metric_suffix
from trainer_hook.text import one_line

#: The newest record format this reader knows: the one the hook of this version writes.
KNOWN_FORMAT = FORMAT_VERSION
_ROTATED = re.compile(r"^(?P<stem>.+)\.(?P<n>\d+)\.jsonl$")
#: Problem kinds whose plural is not the kind plus "s".
_PLURALS = {"run mixed into another run's file": "runs mixed into another run's file",
            "step line before any start line": "step lines before any start line",
            "end line before any start line": "end lines before any start line",
            "file that is not a regular file": "files that are not regular files",
            "line timed before its run's start": "lines timed before their run's start"}
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "+inf": math.inf}
#: A longer line is skipped (read and dropped a piece at a time, never held whole).
MAX_LINE_BYTES = 4 << 20
#: JSON nested deeper than this is a corrupt line (the hook writes depth 3).
MAX_DEPTH = 64
#: Step numbers beyond this are not exact in a float64 sample: a corrupt line.
MAX_STEP = 2 ** 53
#: How far a line's time may be before its run's start, or after the present (clock steps, skew).
CLOCK_SLACK_SECONDS = 3600.0
#: The launch id of a start line that names none (older hooks): its start time, UTC.
LAUNCH_TIME_FORMAT = "%Y%m%dT%H%M%SZ"
#: A lone surrogate can come escaped or as raw bytes (json.loads decodes with "surrogatepass").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class InputError(Exception):
    """An input path that cannot be used (missing, not a record): one line for the user."""


@dataclass
class Run:
    """One rank of one run, as its start line (and end line, once read) describe it; job, run, rank
    and instance are label values as the hook makes them (contract.label_value: at most
    MAX_LABEL_LENGTH characters, no control characters)."""

    job: str
    run: str
    rank: str
    instance: str
    start_time: float | None
    format: int
    start: dict[str, Any]
    end: dict[str, Any] | None = None
    steps: int = 0
    launch: str = ""  # which launch of the run id (the start line's, else its start time)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.job, self.run, self.rank)

    @property
    def launch_key(self) -> tuple[str, str, str, str]:
        """The rank in one launch of its run: a run id launched again is another Run."""
        return (self.job, self.run, self.rank, self.launch)

    @property
    def name(self) -> str:
        return f"{self.job}/{self.run}/rank{self.rank}"

    @property
    def config(self) -> dict[str, str]:
        """The start line's config as the hook exports it (contract.config_labels: secrets masked,
        names and values sanitized, at most MAX_CONFIG_LABELS), whoever wrote the record."""
        config = self.start.get("config")
        return config_labels(config) if isinstance(config, dict) else {}


@dataclass
class Problems:
    """What the reader skipped, counted by kind, with the first place each kind was seen."""

    counts: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)
    files: int = 0
    newer_format: int = 0

    def add(self, kind: str, where: str) -> None:
        self.counts[kind] += 1
        self.first.setdefault(kind, one_line(where))

    def summary(self) -> str:
        """'2 corrupt lines (first at a.jsonl:17), 1 truncated last line (...)' or ''."""
        parts = [f"{count} {kind if count == 1 else _plural(kind)} (first at {self.first[kind]})"
                 for kind, count in sorted(self.counts.items())]
        if self.newer_format:
            parts.append(f"{self.newer_format} start line(s) of a format newer than {KNOWN_FORMAT} "
                         f"(read as {KNOWN_FORMAT}; upgrade dualtrack)")
        return ", ".join(parts)


def _plural(kind: str) -> str:
    """'corrupt line' -> 'corrupt lines', 'line timed in the future' -> 'lines timed in the future'."""
    if kind in _PLURALS:
        return _PLURALS[kind]
    return "lines" + kind[4:] if kind.startswith("line ") else kind + "s"


def expand(paths: Iterable[str | Path], problems: Problems | None = None) -> list[Path]:
    """Files to read, in order: a directory gives its *.jsonl; rotated parts come oldest first.

    A directory's entries that are not regular files (FIFOs, devices, folders) are counted in
    `problems` and left out. Raises InputError for a path that does not exist, is neither a
    directory nor a regular file, or a directory without records.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise InputError(f"{path}: directory holds no *.jsonl record")
            for entry in found:
                if entry.is_file():
                    files.append(entry)
                elif problems is not None:
                    problems.add("file that is not a regular file", entry.name)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise InputError(f"{path}: not a regular file")
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
        try:
            return float(value)
        except OverflowError:  # an int beyond float64
            return None
    if isinstance(value, str):
        return _NONFINITE.get(value.lower())
    return None


def open_record(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file (symlinks followed); never blocks on a FIFO.

    Raises InputError for anything else (FIFO, device, directory, socket), OSError when unreadable.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def lines(handle: BinaryIO) -> Iterator[bytes | None]:
    """The lines of `handle`, each read at most MAX_LINE_BYTES at a time; None for a longer line."""
    while True:
        raw = handle.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = handle.readline(MAX_LINE_BYTES)
        yield None


def first_line(path: Path) -> dict[str, Any] | None:
    """The parsed first line of a record, or None (not a regular file, unreadable, not an object)."""
    try:
        with open_record(path) as handle:
            raw = next(lines(handle), None)
    except (OSError, InputError):
        return None
    return _parse(raw) if raw else None


class Reader:
    """Iterates (run, line) over record files: step lines, then the end line of each run.

    Step lines are dicts as written, with "step" an int and "time" a float; "values" holds only
    readable numbers (floats, NaN/Inf included); "nonfinite" lists the keys that make the step
    non-finite (not an overflow of a skipped step), as the live hook counts them. `problems` and
    `runs` fill in as it goes.
    """

    def __init__(self, paths: Iterable[str | Path], keep: Callable[[Run], bool] | None = None) -> None:
        self.problems = Problems()
        self.files = expand(paths, self.problems)
        self.problems.files = len(self.files)
        self.runs: dict[tuple[str, str, str, str], Run] = {}  # by launch_key
        self.keep = keep  # which runs' lines to yield (None: all)
        self.consumed = 0  # bytes of the records read so far, skipped lines included

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
            handle = open_record(path)
        except InputError:
            self.problems.add("file that is not a regular file", path.name)
            return
        except OSError as exc:
            self.problems.add("unreadable file", f"{path.name}: {exc.strerror}")
            return
        with handle:
            number_ = 0
            for number_, raw in enumerate(lines(handle), 1):
                self.consumed += MAX_LINE_BYTES if raw is None else len(raw)
                where = f"{path.name}:{number_}"
                if raw is None:
                    self.problems.add(f"line longer than {MAX_LINE_BYTES} bytes", where)
                    continue
                line = _parse(raw)
                if line is None:
                    if raw.strip():
                        last = not raw.endswith(b"\n")
                        self.problems.add("truncated last line" if last else "corrupt line", where)
                    continue
                event = line.get("event")
                if event == "start":
                    run = current = self._start(line, where)
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
                    elif (bad := _bad_time(step["time"], current)) is not None:
                        self.problems.add(bad, where)
                    elif self.keep is None or self.keep(current):
                        step["time"] = float(step["time"])
                        current.steps += 1
                        yield current, step
                elif event == "pause":
                    if current is None:
                        self.problems.add("pause line before any start line", where)
                    elif not _pause_line(line):
                        self.problems.add("corrupt line", where)
                    elif (bad := _bad_time(line["time"], current)) is not None:
                        self.problems.add(bad, where)
                    else:
                        line["time"], line["seconds"] = float(line["time"]), float(line["seconds"])
                        yield current, line
                elif event == "end":
                    if current is None:
                        self.problems.add("end line before any start line", where)
                    elif type(line.get("time")) not in (int, float):
                        self.problems.add("corrupt line", where)
                    elif (bad := _bad_time(line["time"], current)) is not None:
                        self.problems.add(bad, where)
                    elif self.keep is None or self.keep(current):
                        line["time"] = float(line["time"])
                        current.end = line
                        yield current, line
            if number_ == 0:
                self.problems.add("empty file", path.name)

    def _start(self, line: dict[str, Any], where: str) -> Run | None:
        try:
            job, run, rank = (label_value(line[k]) for k in ("job", "run", "rank"))
        except KeyError:
            self.problems.add("corrupt line", where)
            return None
        version = line.get("format", 1)
        start_time = line.get("time")
        usable = type(start_time) in (int, float) and _bad_time(start_time, None) is None
        launch = line.get("launch")
        # A record written before launches were named: each start time is a launch.
        launch = label_value(launch) if isinstance(launch, str) and launch.strip() else \
            clock.strftime(LAUNCH_TIME_FORMAT, clock.gmtime(start_time)) if usable else ""
        if isinstance(version, int) and version > KNOWN_FORMAT and (job, run, rank, launch) not in self.runs:
            self.problems.newer_format += 1
        known = self.runs.get((job, run, rank, launch))
        if known is not None:
            return known
        made = Run(job=job, run=run, rank=rank, instance=label_value(line.get("instance", "")),
                   start_time=float(start_time) if usable else None,
                   format=version if isinstance(version, int) else 1, start=line, launch=launch)
        self.runs[made.launch_key] = made
        return made


def launches(paths: Iterable[str | Path]) -> list[Run]:
    """Every launch of every rank in the records, as Runs without steps: a quick pass that parses
    start lines only. Raises InputError as Reader does."""
    reader = Reader(paths)
    for path in reader.files:
        try:
            handle = open_record(path)
        except (InputError, OSError):
            continue  # the reading pass reports it
        with handle:
            for raw in lines(handle):
                if raw is not None and b'"start"' in raw:
                    line = _parse(raw)
                    if line is not None and line.get("event") == "start":
                        reader._start(line, path.name)
    return list(reader.runs.values())


@dataclass
class Launches:
    """Which launch of each job/run to read (the latest, or the one asked for) and the others."""

    keep: set[tuple[str, str, str]]  # (job, run, launch)
    others: list[str]  # one line per job/run launched more than once

    def __call__(self, run: Run) -> bool:
        return (run.job, run.run, run.launch) in self.keep


def select_launches(runs: Iterable[Run], wanted: str | None = None) -> Launches:
    """The latest launch of each job/run (by its first rank's start), or the launch `wanted`; a line
    naming the others for each job/run that has them. Raises InputError when no run has `wanted`."""
    starts: dict[tuple[str, str], dict[str, float]] = {}
    for run in runs:
        found = starts.setdefault((run.job, run.run), {})
        start = run.start_time if run.start_time is not None else -math.inf
        found[run.launch] = min(found.get(run.launch, math.inf), start)
    if wanted is not None and not any(wanted in found for found in starts.values()):
        known = sorted({launch for found in starts.values() for launch in found})
        raise InputError(f"--launch {wanted}: no such launch in the records (launches: {', '.join(known)})")
    keep: set[tuple[str, str, str]] = set()
    others = []
    for (job, run), found in starts.items():
        order = sorted(found, key=lambda launch: (found[launch], launch))
        chosen = order[-1] if wanted is None else wanted
        if chosen not in found:
            continue
        keep.add((job, run, chosen))
        if len(order) > 1:
            others.append(f"run {run} (job {job}): launch {chosen} (started {_when(found[chosen])}); other "
                          f"launches: {', '.join(f'{o} (started {_when(found[o])})' for o in order if o != chosen)};"
                          " pick one with --launch ID")
    return Launches(keep, others)


def _when(start: float) -> str:
    return clock.strftime("%Y-%m-%d %H:%M:%S UTC", clock.gmtime(start)) if math.isfinite(start) else "?"


def _parse(raw: bytes) -> dict[str, Any] | None:
    """A JSON object line, or None (not JSON, too deep, not an object); lone surrogates -> U+FFFD."""
    if (raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(raw) > MAX_DEPTH):
        return None
    try:
        line = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, too many digits
        return None
    if not isinstance(line, dict):
        return None
    return _mend(line) if _SURROGATE_ESCAPE.search(raw) else line


def _depth(raw: bytes) -> int:
    """The deepest nesting of brackets in a JSON text, strings skipped."""
    depth = deepest = 0
    for token in re.finditer(rb'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', raw):
        char = token[0][:1]
        if char in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in b"]}":
            depth -= 1
    return deepest


def _mend(value: Any) -> Any:
    """`value` with every lone surrogate in its strings (keys included) replaced by U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_mend(item) for item in value]
    if isinstance(value, dict):
        return {_mend(key): _mend(item) for key, item in value.items()}
    return value


def _bad_time(time: int | float, run: Run | None) -> str | None:
    """Why a line's time cannot be used (a problem kind), or None when it is plausible.

    Not before the run's start (when the start line gave one) nor after the present, each with
    CLOCK_SLACK_SECONDS of slack, and never before 1970.
    """
    if isinstance(time, float) and not math.isfinite(time):
        return "line with a non-finite time"
    if time > clock.time() + CLOCK_SLACK_SECONDS:
        return "line timed in the future"
    start = run.start_time if run is not None and run.start_time is not None else CLOCK_SLACK_SECONDS
    if time < start - CLOCK_SLACK_SECONDS:
        return "line timed before its run's start"
    return None


def _pause_line(line: dict[str, Any]) -> bool:
    """A pause line (monitor.paused()): a reason, its start time and its finite length in seconds."""
    seconds = line.get("seconds")
    return (isinstance(line.get("reason"), str) and type(line.get("time")) in (int, float)
            and type(seconds) in (int, float) and 0 <= seconds < math.inf)


def _step_line(line: dict[str, Any]) -> dict[str, Any] | None:
    """The line with its numbers checked, or None when step/time/values are unusable."""
    step, time = line.get("step"), line.get("time")
    values = line.get("values", {})
    if (type(step) is not int or not -MAX_STEP <= step <= MAX_STEP or type(time) not in (int, float)
            or not isinstance(values, dict)):
        return None
    line["values"] = values = {str(k): v for k, v in ((k, number(v)) for k, v in values.items()) if v is not None}
    # The step's non-finite keys, by the live hook's own rule (trainer_hook.contract).
    skipped = line.get("skipped")
    line["nonfinite"] = [k for k, v in values.items() if not math.isfinite(v)
                         and (suffix := exported_name(k)) is not None and not is_overflow(suffix, skipped)]
    return line
