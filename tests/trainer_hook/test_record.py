"""The local record's file mechanics: format version, size rotation, crashes mid-write."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dualtrack.records import Reader
from stack.processes import wait_until
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor
from trainer_hook.record import FORMAT_VERSION, Record


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rotation_keeps_every_step_once_in_order_and_each_file_reads_alone(tmp_path: Path) -> None:
    max_bytes = 8192
    with TrainingMonitor(job="rot", run="r1", pushgateway=False, record_path=tmp_path, rank=0,
                         push_interval=0.05, config={"lr": 0.1}, record_max_bytes=max_bytes) as monitor:
        for step in range(400):
            monitor.log({"loss": 1.0 / (step + 1), "learning_rate": 0.1}, step=step, samples=4)
    names = sorted(p.name for p in tmp_path.iterdir())
    rotated = sorted((p for p in tmp_path.glob("rot-r1-rank0.*.jsonl")), key=lambda p: int(p.name.split(".")[1]))
    assert len(rotated) >= 5, names
    assert [p.name for p in rotated] == [f"rot-r1-rank0.{n}.jsonl" for n in range(1, len(rotated) + 1)]
    files = rotated + [tmp_path / "rot-r1-rank0.jsonl"]
    steps = []
    for number, path in enumerate(files):
        assert path.stat().st_size <= max_bytes, path
        lines = _lines(path)
        start = lines[0]
        assert start["event"] == "start" and start["format"] == FORMAT_VERSION
        assert start["run"] == "r1" and start["config"] == {"lr": "0.1"}
        assert start.get("continued", False) is (number > 0)
        steps += [line["step"] for line in lines if "event" not in line]
    assert steps == list(range(400))
    assert _lines(files[-1])[-1]["event"] == "end"
    # The reader takes the parts in any order, as a directory or as files, and sees one run.
    reader = Reader(reversed(files))
    read = [line["step"] for _, line in reader if "event" not in line]
    assert read == list(range(400))
    assert len(reader.runs) == 1 and not reader.problems.counts


def test_rotation_continues_the_numbering_of_earlier_rotated_files(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    (tmp_path / "a.1.jsonl").write_text('{"event": "start", "job": "j", "run": "r", "rank": 0}\n')
    record = Record(path, max_bytes=4096)
    record.write([{"event": "start", "job": "j", "run": "r", "rank": 0, "time": 1.0}])
    record.write([{"time": 1.0 + i, "step": i, "values": {"loss": 0.5}, "pad": "x" * 200} for i in range(40)])
    record.close()
    assert (tmp_path / "a.1.jsonl").read_text().count("\n") == 1  # the earlier file is untouched
    assert (tmp_path / "a.2.jsonl").is_file() and (tmp_path / "a.3.jsonl").is_file()


def test_a_partial_last_line_is_skipped_by_readers_and_cut_by_the_next_writer(tmp_path: Path) -> None:
    path = tmp_path / "crashed.jsonl"
    full = ['{"event": "start", "job": "j", "run": "r", "rank": 0, "time": 1.0}'] + [
        json.dumps({"time": 2.0 + i, "step": i, "values": {"loss": 1.0}}) for i in range(3)]
    path.write_text("\n".join(full) + "\n" + '{"time": 5.0, "step": 3, "val')
    reader = Reader([path])
    assert [line["step"] for _, line in reader] == [0, 1, 2]
    assert dict(reader.problems.counts) == {"truncated last line": 1}
    assert "1 truncated last line (first at crashed.jsonl:5)" in reader.problems.summary()

    record = Record(path)  # the run resumes (same job/run/rank): the partial line goes first
    record.write([{"time": 6.0, "step": 3, "values": {"loss": 0.9}}])
    record.close()
    reader = Reader([path])
    assert [line["step"] for _, line in reader] == [0, 1, 2, 3]
    assert not reader.problems.counts


def test_sigkill_mid_run_leaves_at_most_one_truncated_last_line(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import itertools
        from trainer_hook import TrainingMonitor
        monitor = TrainingMonitor(job="kill", run="k", pushgateway=False, rank=0,
                                  record_path={str(tmp_path)!r}, push_interval=0.01, record_max_bytes=65536)
        for step in itertools.count():
            monitor.log({{"loss": 1.0, "note": step * 0.5}}, step=step, samples=1, batch_id=step)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        # Past two rotations and still writing.
        wait_until(lambda: (tmp_path / "kill-k-rank0.2.jsonl").exists(), 60, what="two rotations")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    reader = Reader([tmp_path])
    steps = [line["step"] for _, line in reader]
    assert steps == list(range(len(steps))) and len(steps) > 500
    assert set(reader.problems.counts) <= {"truncated last line"}
    assert reader.problems.counts["truncated last line"] <= 1
    assert next(iter(reader.runs.values())).end is None  # no end line: the report says it died


def test_format_1_lines_without_a_version_are_read(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    path.write_text(
        '{"event": "start", "time": 10.0, "job": "old", "run": "r0", "rank": 0, "instance": "n1", "config": {}}\n'
        '{"time": 10.5, "step": 0, "batch_id": 0, "samples": 8, "tokens": null, "duration_seconds": null, '
        '"values": {"train/loss": "nan", "lr": 0.1}, "nonfinite": ["train/loss"]}\n'
        '{"event": "end", "time": 11.0, "state": "failed", "steps": 1, "reason": "RuntimeError"}\n')
    reader = Reader([path])
    lines = list(reader)
    run = reader.runs[("old", "r0", "0", "19700101T000010Z")]
    assert run.format == 1 and run.end["reason"] == "RuntimeError"
    values = lines[0][1]["values"]
    assert values["lr"] == 0.1 and values["train/loss"] != values["train/loss"]  # NaN


@pytest.mark.parametrize("bad", [10, 4095, True, 1.5e6, "1M"])
def test_an_unusable_record_max_bytes_is_refused_at_construction(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="record_max_bytes"):
        TrainingMonitor(job="j", run="r", pushgateway=False, record_path=tmp_path, record_max_bytes=bad)


def test_a_line_longer_than_the_limit_gets_a_file_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    record = Record(path, max_bytes=4096)
    record.write([{"event": "start", "job": "j", "run": "r", "rank": 0, "time": 1.0, "config": {"x": "y" * 3000}}])
    record.write([{"time": 2.0 + i, "step": i, "values": {"loss": 1.0}, "blob": "z" * 5000 * (i % 2)}
                  for i in range(4)])
    record.close()
    reader = Reader([tmp_path])
    assert [line["step"] for _, line in reader] == [0, 1, 2, 3] and not reader.problems.counts
    assert len(list(tmp_path.iterdir())) <= 5
