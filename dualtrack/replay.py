"""`dualtrack replay RECORD... --out DIR`: local records -> Prometheus TSDB blocks at step resolution.

The records are read one line at a time and written as OpenMetrics chunks of at most
CHUNK_SAMPLES samples; `promtool tsdb create-blocks-from openmetrics` turns each chunk into blocks
(the next chunk is written while promtool works on the previous one). Memory stays flat whatever
the record's length, promtool's included (it loads its whole input file).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable

from .cli import fail

HELP = "rebuild a run's Prometheus series (step resolution) from its local record, as TSDB blocks"
#: In DIR: which replayed runs each block holds, so that a second replay replaces the first.
MANIFEST = "dualtrack-replay.json"
CHUNK_SAMPLES = 1_000_000
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
                             "or one to load with `python -m stack --replay DIR`")
    parser.add_argument("--promtool", default=None, metavar="PATH",
                        help="promtool binary (default: promtool on PATH)")


def run(args: argparse.Namespace) -> int:
    from .records import InputError, Reader
    promtool = args.promtool or shutil.which("promtool")
    if promtool is None or not os.access(promtool, os.X_OK):
        return fail("replay", PROMTOOL_MISSING if args.promtool is None else f"--promtool {args.promtool}: not an executable")
    try:
        reader = Reader(args.records)
    except InputError as exc:
        return fail("replay", str(exc), 2)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".dualtrack-replay-", dir=args.out) as work:
            builder = BlockBuilder(Path(work), promtool)
            samples = write_openmetrics(reader, builder)
            builder.finish()
            if samples == 0:
                return fail("replay", "nothing to replay: " + reader.no_steps())
            blocks = install_blocks(builder.blocks_dir, args.out, [run.name for run in reader.runs.values()])
    except ReplayError as exc:
        return fail("replay", str(exc))
    except OSError as exc:
        return fail("replay", f"{exc.filename or args.out}: {exc.strerror}")
    steps = sum(run.steps for run in reader.runs.values())
    print(f"replayed {len(reader.runs)} run(s) ({steps} steps, {samples} samples) from "
          f"{len(reader.files)} file(s) into {args.out}: {blocks} block(s); series carry replayed=\"true\"")
    reader.print_skipped("replay")
    return 0


def write_openmetrics(reader: Iterable, builder: "BlockBuilder") -> int:
    """Stream the reader's lines into the builder; returns the number of samples written."""
    from .openmetrics import RunSeries
    series: dict[tuple[str, str, str], RunSeries] = {}
    problems = getattr(reader, "problems", None)
    for run, line in reader:
        state = series.get(run.key)
        if state is None:
            state = series[run.key] = RunSeries(run)
        if "event" in line:
            builder.write(state.end(line), 0)
        elif state.in_order(line):
            before = state.samples
            text = state.step(line)
            builder.write(text, state.samples - before)
        elif problems is not None:
            problems.add("repeated or out-of-order step line", f"{run.name} step {line['step']}")
    return sum(state.samples for state in series.values())


class BlockBuilder:
    """OpenMetrics text in chunks; promtool builds each chunk's blocks into `blocks_dir`."""

    def __init__(self, work: Path, promtool: str) -> None:
        self.work = work
        self.promtool = promtool
        self.blocks_dir = work / "blocks"
        self.blocks_dir.mkdir()
        self._chunk_number = 0
        self._chunk = None
        self._chunk_path: Path | None = None
        self._chunk_samples = 0
        self._running: tuple[subprocess.Popen, Path] | None = None

    def write(self, text: str, samples: int) -> None:
        if self._chunk is None:
            self._chunk_number += 1
            self._chunk_path = self.work / f"chunk-{self._chunk_number}.om"
            self._chunk = open(self._chunk_path, "w", encoding="utf-8", buffering=1 << 20)
            self._chunk_samples = 0
        self._chunk.write(text)
        self._chunk_samples += samples
        if self._chunk_samples >= CHUNK_SAMPLES:
            self._close_chunk()

    def _close_chunk(self) -> None:
        if self._chunk is None:
            return
        self._chunk.write("# EOF\n")
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
        self._running = None
        _, stderr = process.communicate()
        path.unlink(missing_ok=True)
        if process.returncode != 0:
            last = (stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ReplayError(f"promtool could not build blocks (exit {process.returncode}): {last}")

    def finish(self) -> None:
        """Build the last chunk and wait for promtool."""
        self._close_chunk()
        self._wait()


def install_blocks(blocks_dir: Path, out: Path, runs: list[str]) -> int:
    """Move the new blocks into `out`; delete earlier replays' blocks that held only these runs.

    Returns the number of new blocks. The manifest in `out` maps block id -> replayed runs.
    """
    manifest_path = out / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest, dict):
            manifest = {}
    except (OSError, ValueError):
        manifest = {}
    replaced = set(runs)
    for block, held in list(manifest.items()):
        if isinstance(held, list) and set(held) <= replaced:
            shutil.rmtree(out / block, ignore_errors=True)
            del manifest[block]
    new = sorted(p.name for p in blocks_dir.iterdir() if (p / "meta.json").is_file())
    for block in new:
        os.replace(blocks_dir / block, out / block)
        manifest[block] = sorted(replaced)
    temporary = manifest_path.with_name(MANIFEST + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, manifest_path)
    return len(new)
