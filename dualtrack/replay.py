"""`dualtrack replay RECORD... --out DIR`: local records -> Prometheus TSDB blocks at step resolution.

The records are read one line at a time and written as OpenMetrics chunks of at most
CHUNK_SAMPLES samples; `promtool tsdb create-blocks-from openmetrics` turns each chunk into blocks
(the next chunk is written while promtool works on the previous one). Memory stays flat whatever
the record's length, promtool's included (it loads its whole input file).

Records are untrusted (dualtrack.records checks every line); the blocks are installed by
dualtrack.manifest, which deletes nothing the replay did not make; the temporary folder is
dualtrack.workspace's, removed on exit, on SIGINT/SIGTERM/SIGHUP, or by a later replay once stale.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from .console import fail
from .manifest import Coverage, ManifestError, install
from .records import InputError, Reader, launches, select_launches
from .workspace import Interrupted, remove_stale, workspace

HELP = "rebuild a run's Prometheus series (step resolution) from its local record, as TSDB blocks"
CHUNK_SAMPLES = 1_000_000
#: A chunk is also closed at this size: promtool reads each chunk whole.
CHUNK_BYTES = 64 << 20
#: Default of --max-output-bytes: the OpenMetrics text one replay may write in all.
MAX_OUTPUT_BYTES = 16 << 30
PROMTOOL_MISSING = ("promtool not found: install it (Debian/Ubuntu: apt-get install prometheus; "
                    "elsewhere the prometheus-*.tar.gz from https://prometheus.io/download/ has it) "
                    "or pass --promtool PATH")


class ReplayError(Exception):
    """A failure to report in one line (exit 1)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", nargs="+", metavar="RECORD",
                        help="record files (<job>-<run>-rank<r>.jsonl and rotated <stem>.<n>.jsonl) "
                             "or directories of them")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="directory for the blocks: a Prometheus data directory (--storage.tsdb.path) "
                             "or one to load with `bash scripts/up --replay DIR`")
    parser.add_argument("--promtool", default=None, metavar="PATH",
                        help="promtool binary (default: promtool on PATH)")
    parser.add_argument("--launch", metavar="ID", default=None,
                        help="the launch to replay when a run id was launched more than once on the same "
                             "records (default: the latest; the others are listed)")
    parser.add_argument("--max-output-bytes", type=_byte_count, default=MAX_OUTPUT_BYTES, metavar="N",
                        help=f"stop with an error once the OpenMetrics text for promtool would pass N bytes "
                             f"(default {MAX_OUTPUT_BYTES}, 16 GiB: about 6 M steps logging 3 keys)")


def _byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive number of bytes: {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    promtool = args.promtool or shutil.which("promtool")
    if promtool is None or not os.access(promtool, os.X_OK):
        return fail("replay", PROMTOOL_MISSING if args.promtool is None
                    else f"--promtool {args.promtool}: not an executable")
    try:
        chosen = select_launches(launches(args.records), args.launch)
        reader = Reader(args.records, keep=chosen)
    except InputError as exc:
        return fail("replay", str(exc), 2)
    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
        stale = remove_stale(out)
        with workspace(out) as work, BlockBuilder(work, promtool, args.max_output_bytes) as builder:
            runs = write_openmetrics(reader, builder)
            builder.finish()
            samples = sum(samples for _, samples in runs)
            if samples == 0:
                return fail("replay", "nothing to replay: " + reader.no_steps())
            blocks, replaced = install(builder.blocks_dir, out, [coverage for coverage, _ in runs])
    except (Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        return fail("replay", f"interrupted by {signal.Signals(signum).name}", 128 + signum)
    except (ReplayError, ManifestError) as exc:
        return fail("replay", str(exc))
    except OSError as exc:
        return fail("replay", f"{exc.filename or out}: {exc.strerror}")
    steps = sum(coverage.steps for coverage, _ in runs)
    notes = [f"replaced {replaced} block(s) of an earlier replay"] if replaced else []
    notes += [f"removed {stale} temporary folder(s) of killed replays"] if stale else []
    print(f"replayed {len(runs)} run(s) ({steps} steps, {samples} samples) from "
          f"{len(reader.files)} file(s) into {out}: {blocks} block(s)"
          + "".join(f", {note}" for note in notes) + "; series carry replayed=\"true\"")
    for line in chosen.others:  # after the work: a failure says one line, its error
        print(f"dualtrack replay: {line}", file=sys.stderr)
    reader.print_skipped("replay")
    return 0


def write_openmetrics(reader: Reader, builder: BlockBuilder) -> list[tuple[Coverage, int]]:
    """Stream the reader's lines into the builder; (what was written, samples) for each run."""
    from .openmetrics import RunSeries
    series: dict[tuple[str, str, str], RunSeries] = {}
    spans: dict[tuple[str, str, str], list] = {}  # key -> [steps, first time, last time]
    problems = reader.problems
    consumed = 0
    for run, line in reader:
        state = series.get(run.key)
        if state is None:
            state = series[run.key] = RunSeries(run)
            spans[run.key] = [0, line["time"], line["time"]]
        state.read(reader.consumed - consumed)  # the bytes since the previous line: this run's
        consumed = reader.consumed
        if line.get("event") == "pause":
            builder.write(state.pause(line), 0)
        elif "event" in line:
            builder.write(state.end(line), 0)
        elif state.in_order(line):
            before = state.samples
            text = state.step(line)
            builder.write(text, state.samples - before)
            span = spans[run.key]
            span[1] = line["time"] if span[0] == 0 else min(span[1], line["time"])
            span[0], span[2] = span[0] + 1, max(span[2], line["time"])
        else:
            problems.add("repeated or out-of-order step line", f"{run.name} step {line['step']}")
    return [(Coverage(*key, *spans[key]), state.samples) for key, state in series.items()]


class BlockBuilder:
    """OpenMetrics text in chunks; promtool builds each chunk's blocks into `blocks_dir`.

    As a context manager it stops a promtool still running when the block is left early.
    """

    def __init__(self, work: Path, promtool: str, max_bytes: int = MAX_OUTPUT_BYTES) -> None:
        self.work = work
        self.promtool = promtool
        self.max_bytes = max_bytes
        self.written = 0  # bytes of OpenMetrics text, all chunks
        self.blocks_dir = work / "blocks"
        self.blocks_dir.mkdir()
        self._chunk_number = 0
        self._chunk = None
        self._chunk_path: Path | None = None
        self._chunk_samples = self._chunk_bytes = 0
        self._running: tuple[subprocess.Popen, Path] | None = None

    def write(self, text: str, samples: int) -> None:
        """Append samples to the current chunk; raises ReplayError past max_bytes in all."""
        data = text.encode("utf-8", "replace")
        self.written += len(data)
        if self.written > self.max_bytes:
            raise ReplayError(f"the replay would write more than --max-output-bytes {self.max_bytes} "
                              f"bytes of OpenMetrics text: raise the bound, or replay fewer records at once")
        if self._chunk is None:
            self._chunk_number += 1
            self._chunk_path = self.work / f"chunk-{self._chunk_number}.om"
            self._chunk = open(self._chunk_path, "wb", buffering=1 << 20)
            self._chunk_samples = self._chunk_bytes = 0
        self._chunk.write(data)
        self._chunk_samples += samples
        self._chunk_bytes += len(data)
        if self._chunk_samples >= CHUNK_SAMPLES or self._chunk_bytes >= CHUNK_BYTES:
            self._close_chunk()

    def _close_chunk(self) -> None:
        if self._chunk is None:
            return
        self._chunk.write(b"# EOF\n")
        self._chunk.close()
        self._chunk = None
        self._wait()
        process = subprocess.Popen([self.promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet",
                                    str(self._chunk_path), str(self.blocks_dir)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._running = (process, self._chunk_path)

    def _wait(self) -> None:
        if self._running is None:
            return
        process, path = self._running
        _, stderr = process.communicate()
        self._running = None  # only now: an interrupted wait leaves it for __exit__ to stop
        path.unlink(missing_ok=True)
        if process.returncode != 0:
            last = (stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ReplayError(f"promtool could not build blocks (exit {process.returncode}): {last}")

    def finish(self) -> None:
        """Build the last chunk and wait for promtool."""
        self._close_chunk()
        self._wait()

    def __enter__(self) -> BlockBuilder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._chunk is not None:
            self._chunk.close()
            self._chunk = None
        if self._running is not None:
            process, _ = self._running
            self._running = None
            process.kill()
            process.communicate()

