"""One run id launched twice on the same records: each launch is its own, never mixed. `dualtrack report`
and `replay` read the latest by default, list the others, and read one with --launch; its state is its own."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dualtrack.cli import main
from dualtrack.records import LAUNCH_TIME_FORMAT
from tests.support.hook import Trainer, run_id
from trainer_hook import TrainingMonitor


def two_launches(tmp_path: Path, monkeypatch) -> tuple[str, Path, list[str], TrainingMonitor]:
    """A run id launched twice on one record: 30 steps then finished, then 12 steps and still running
    (its monitor open). Returns (run id, records folder, the two launch ids, the live monitor)."""
    monkeypatch.setenv("DUALTRACK_DELETE_AFTER", "none")
    records = tmp_path / "records"
    run = run_id("relaunch")
    record = records / f"train-{run}-rank0.jsonl"
    with TrainingMonitor(job="train", run=run, pushgateway=False, record_path=record) as first:
        trainer = Trainer()
        for _ in range(30):
            trainer.train_step(first)
    second = TrainingMonitor(job="train", run=run, pushgateway=False, record_path=record)
    trainer = Trainer()
    for _ in range(12):
        trainer.train_step(second)
    # The hook writes a launch's start line with its first steps, from its worker thread.
    from stack.processes import wait_until
    wait_until(lambda: record.read_text().count('"event": "start"') >= 2, 30, what="the second start line")
    starts = [json.loads(line) for line in record.read_text().splitlines() if '"event": "start"' in line]
    return run, records, [start["launch"] for start in starts], second


def facts(page: str) -> dict[str, str]:
    return dict(re.findall(r"<tr><th>([^<]+)</th><td>([^<]*)</td></tr>", page.split('<table class="facts">')[1]
                           .split("</table>")[0]))


def wait_for_steps(record: Path, steps: int) -> None:
    from stack.processes import wait_until
    wait_until(lambda: sum(1 for line in record.read_text().splitlines() if '"step"' in line) >= steps, 30,
               what=f"{steps} step lines in {record}")


def test_a_relaunched_run_reports_its_latest_launch_alone_and_names_the_other(tmp_path, monkeypatch, capsys):
    run, records, ids, live = two_launches(tmp_path, monkeypatch)
    try:
        assert len(ids) == 2 and ids[0] != ids[1], ids  # the hook names each launch
        wait_for_steps(next(records.iterdir()), 42)
        out = tmp_path / "latest.html"
        assert main(["report", run, "--records", str(records), "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert f"launch {ids[1]}" in err and f"other launches: {ids[0]}" in err and "--launch ID" in err
        page = out.read_text()
        shown = facts(page)
        assert shown["launch"] == ids[1]
        assert shown["state"].startswith("running")  # the live launch, not the finished one
        assert shown["steps in record"] == "12" and shown["first step"].startswith("0 at")
        assert shown["last step"].startswith("11 at")  # no line wraps back from the first launch's steps
        assert ids[0] in page.split('id="notes"')[1].split("</ul>")[0]

        earlier = tmp_path / "earlier.html"
        assert main(["report", run, "--records", str(records), "--out", str(earlier), "--launch", ids[0]]) == 0
        shown = facts(earlier.read_text())
        assert shown["launch"] == ids[0] and shown["state"] == "finished" and shown["steps in record"] == "30"

        assert f"launch {ids[0]}" in capsys.readouterr().err
        assert main(["report", run, "--records", str(records), "--out", str(earlier), "--launch", "nope"]) == 2
        err = capsys.readouterr().err
        assert "--launch nope: no such launch" in err and ids[0] in err and len(err.strip().splitlines()) == 1
    finally:
        live.close()


def test_a_record_without_launch_ids_splits_on_its_start_lines(tmp_path, capsys):
    """Records of older hooks name no launch: each start line that is not a rotation's is one."""
    record = tmp_path / "old.jsonl"
    lines = []
    for start, steps in ((1000.0, 20), (5000.0, 5)):
        lines.append({"event": "start", "format": 2, "time": start, "job": "j", "run": "old", "rank": 0,
                      "instance": "n1"})
        lines += [{"time": start + n, "step": n, "values": {"loss": 1.0}} for n in range(steps)]
        lines.append({"event": "end", "time": start + steps, "state": "finished"})
    record.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "old.html"
    assert main(["report", str(record), "--out", str(out)]) == 0
    assert "other launches: 19700101T001640Z" in capsys.readouterr().err
    import time
    assert time.strftime(LAUNCH_TIME_FORMAT, time.gmtime(1000.0)) == "19700101T001640Z"
    assert facts(out.read_text())["steps in record"] == "5"


@pytest.mark.parametrize("launch", [None, 0])
def test_replay_writes_one_launch(tmp_path, monkeypatch, capsys, launch):
    run, records, ids, live = two_launches(tmp_path, monkeypatch)
    live.close()
    args = ["replay", str(records), "--out", str(tmp_path / "blocks")]
    if launch is not None:
        args += ["--launch", ids[launch]]
    assert main(args) == 0
    captured = capsys.readouterr()
    chosen, other = (ids[1], ids[0]) if launch is None else (ids[0], ids[1])
    assert f"launch {chosen}" in captured.err and f"other launches: {other}" in captured.err
    assert f"({30 if launch == 0 else 12} steps," in captured.out
