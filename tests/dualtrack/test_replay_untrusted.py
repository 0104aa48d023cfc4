"""`dualtrack replay` and `report` on records and folders from anyone: nothing outside --out is
touched, no data the replay does not rewrite is lost, and every hostile input is a counted skip or
one error line (never a traceback, a hang or a runaway read)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dualtrack.cli import main
from stack.processes import wait_until
from tests.support.paths import REPO
from tests.support.process import default_signal_actions
from tests.support.records import START, dump, step, write

NOW = time.time()
LIVE = {**START, "time": NOW - 600}


def live_step(n: int, **extra) -> dict:
    """Step n of a run that started 10 minutes ago, one step a second."""
    return step(n, NOW - 600 + n, **extra)


def steps_of(out: Path, **labels: str) -> list[int]:
    """The replayed training_step values of the runs matching `labels`."""
    return [int(float(v)) for found, v, _ in dump(out, "training_step")
            if all(found.get(k) == want for k, want in labels.items())]


def tree(root: Path) -> dict[str, tuple]:
    """Every path under `root` with its type, size and mtime: a snapshot to compare."""
    found = {}
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        found[str(path)] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


# -- Nothing outside --out, nothing the replay did not create --------------------------------------

@pytest.mark.parametrize("shape", ["legacy", "current"])
def test_a_manifest_naming_paths_outside_out_deletes_nothing(tmp_path: Path, shape: str) -> None:
    victim = tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    (victim / "keep" / "data").write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    names = ["../victim", str(victim), "..", "."]
    if shape == "legacy":
        manifest = {name: [] for name in names}
    else:
        manifest = {"format": 2, "blocks": {name: {"meta_sha256": "0" * 64, "runs": []} for name in names}}
    (out / "dualtrack-replay.json").write_text(json.dumps(manifest))
    before = tree(victim)
    record = write(tmp_path / "a.jsonl", [LIVE, live_step(0), live_step(1)])
    assert main(["replay", str(record), "--out", str(out)]) == 0
    assert tree(victim) == before
    assert steps_of(out) == [0, 1]


def test_a_block_the_replay_did_not_make_is_never_deleted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    foreign = out / "01ARZ3NDEKTSV4RRFFQ69G5FAV"  # a live Prometheus block, say
    foreign.mkdir(parents=True)
    (foreign / "meta.json").write_text('{"ulid": "01ARZ3NDEKTSV4RRFFQ69G5FAV"}')
    (out / "dualtrack-replay.json").write_text(json.dumps({foreign.name: ["j/r1/rank0"]}))
    record = write(tmp_path / "a.jsonl", [LIVE, live_step(0)])
    assert main(["replay", str(record), "--out", str(out)]) == 0
    assert (foreign / "meta.json").read_text() == '{"ulid": "01ARZ3NDEKTSV4RRFFQ69G5FAV"}'


@pytest.mark.parametrize("manifest_format", [2, 3])
def test_a_forged_manifest_entry_naming_a_foreign_block_never_deletes_it(tmp_path: Path,
                                                                         manifest_format: int) -> None:
    """A real TSDB block in --out (promtool's, as a Prometheus writes them) with an entry that has its
    true meta.json hash and claims runs the replay rewrites in full: it lacks the replay's proof
    file, so it stays."""
    import hashlib
    out = tmp_path / "out"
    out.mkdir()
    text = tmp_path / "foreign.om"
    text.write_text(f'up{{job="prometheus"}} 1 {NOW - 300:.3f}\n# EOF\n')
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(text), str(out)],
                   check=True, capture_output=True)
    (foreign,) = [p for p in out.iterdir() if (p / "meta.json").is_file()]
    before = tree(foreign)
    meta = hashlib.sha256((foreign / "meta.json").read_bytes()).hexdigest()
    runs = [{"job": "j", "run": "r1", "rank": "0", "steps": 1, "first": NOW - 600, "last": NOW - 600}]
    entry = {"meta_sha256": meta, "proof_sha256": hashlib.sha256(b"").hexdigest(), "runs": runs}
    (out / "dualtrack-replay.json").write_text(json.dumps({"format": manifest_format,
                                                           "blocks": {foreign.name: entry}}))
    record = write(tmp_path / "a.jsonl", [LIVE] + [live_step(n) for n in range(5)])
    assert main(["replay", str(record), "--out", str(out)]) == 0
    assert tree(foreign) == before
    # The replay's own blocks carry the proof, and the next replay replaces them (not the foreign one).
    first = {p.name for p in out.iterdir()} - {foreign.name}
    assert main(["replay", str(record), "--out", str(out)]) == 0
    assert tree(foreign) == before and not first & {p.name for p in out.iterdir()} - {"dualtrack-replay.json"}


def test_a_manifest_that_is_not_ours_is_refused_not_overwritten(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "dualtrack-replay.json").write_text("someone's notes\n")
    record = write(tmp_path / "a.jsonl", [LIVE, live_step(0)])
    assert main(["replay", str(record), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dualtrack-replay.json" in err and "not a replay manifest" in err
    assert (out / "dualtrack-replay.json").read_text() == "someone's notes\n"
    assert sorted(p.name for p in out.iterdir()) == ["dualtrack-replay.json"]


# -- Timestamps: checked against the run's start and the present ----------------------------------

@pytest.mark.parametrize("bad_time, kind", [
    ("4102444800", "line timed in the future"),      # 2100: a block there would expire all others
    ("1e15", "line timed in the future"),            # promtool spun for ever on it
    ("1e300", "line timed in the future"),
    ("NaN", "line with a non-finite time"),
    ("Infinity", "line with a non-finite time"),
    ("-Infinity", "line with a non-finite time"),
    ("5", "line timed before its run's start"),
])
def test_a_line_with_a_bad_time_is_skipped_counted_and_the_rest_kept(tmp_path: Path, capsys, bad_time: str,
                                                                     kind: str) -> None:
    bad = json.dumps(live_step(3)).replace(f'"time": {NOW - 597}', f'"time": {bad_time}')
    assert bad_time in bad
    record = write(tmp_path / "a.jsonl", [LIVE, live_step(0), live_step(1), live_step(2), bad]
                   + [live_step(n) for n in range(4, 11)])
    out = tmp_path / "out"
    assert main(["replay", str(record), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"1 {kind} (first at a.jsonl:5)" in err
    assert steps_of(out) == [0, 1, 2] + list(range(4, 11))
    for block in out.iterdir():
        if (block / "meta.json").is_file():
            assert json.loads((block / "meta.json").read_text())["maxTime"] <= (time.time() + 3600) * 1000
    assert main(["report", str(record), "--out", str(tmp_path / "r.html")]) == 0
    assert f"1 {kind}" in capsys.readouterr().err


def test_an_end_line_with_a_bad_time_is_counted(tmp_path: Path, capsys) -> None:
    record = write(tmp_path / "a.jsonl", [LIVE, live_step(0), '{"event": "end", "time": NaN, "state": "failed"}'])
    assert main(["replay", str(record), "--out", str(tmp_path / "out")]) == 0
    assert "1 line with a non-finite time (first at a.jsonl:3)" in capsys.readouterr().err
    assert main(["report", str(record), "--out", str(tmp_path / "r.html")]) == 0


# -- A second replay keeps what it does not rewrite in full ---------------------------------------

def test_a_damaged_record_replayed_beside_another_run_keeps_the_first_replay(tmp_path: Path) -> None:
    out = tmp_path / "out"
    good = write(tmp_path / "r1.jsonl", [LIVE] + [live_step(n) for n in range(5)])
    assert main(["replay", str(good), "--out", str(out)]) == 0
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    write(damaged / "r1.jsonl", [LIVE, "{garbage", live_step(0)])  # one step of five survived
    write(damaged / "r2.jsonl", [{**LIVE, "run": "r2"}] + [live_step(n) for n in range(3)])
    assert main(["replay", str(damaged), "--out", str(out)]) == 0
    assert sorted(set(steps_of(out, run="r1"))) == [0, 1, 2, 3, 4]
    assert steps_of(out, run="r2") == [0, 1, 2]
    write(damaged / "r1.jsonl", [LIVE])  # no step at all: nothing of r1 is rewritten
    assert main(["replay", str(damaged), "--out", str(out)]) == 0
    assert sorted(set(steps_of(out, run="r1"))) == [0, 1, 2, 3, 4]


def test_replaying_the_same_record_again_leaves_one_copy(tmp_path: Path) -> None:
    out = tmp_path / "out"
    record = write(tmp_path / "r1.jsonl", [LIVE] + [live_step(n) for n in range(5)])
    assert main(["replay", str(record), "--out", str(out)]) == 0
    first = {p.name for p in out.iterdir()}
    assert main(["replay", str(record), "--out", str(out)]) == 0
    second = {p.name for p in out.iterdir()}
    assert not (first & second) - {"dualtrack-replay.json"}  # every old block replaced
    assert steps_of(out) == [0, 1, 2, 3, 4]


def test_runs_whose_names_join_alike_do_not_replace_each_other(tmp_path: Path) -> None:
    out = tmp_path / "out"
    one = write(tmp_path / "one.jsonl", [{**LIVE, "job": "team/a", "run": "exp1"}, live_step(0), live_step(1)])
    two = write(tmp_path / "two.jsonl", [{**LIVE, "job": "team", "run": "a/exp1"}, live_step(0), live_step(1)])
    assert main(["replay", str(one), "--out", str(out)]) == 0
    assert main(["replay", str(two), "--out", str(out)]) == 0
    assert steps_of(out, job="team/a", run="exp1") == [0, 1]
    assert steps_of(out, job="team", run="a/exp1") == [0, 1]


# -- Hostile lines: a counted skip or kept, never a traceback -------------------------------------

HOSTILE_LINES = {
    "huge step": f'{{"time": {NOW - 598}, "step": 1{"0" * 4000}, "values": {{"loss": 1.0}}}}',
    "huge value": f'{{"time": {NOW - 598}, "step": 2, "values": {{"loss": 1{"0" * 4000}}}}}',
    "deep nesting": "[" * 200_000,
    "lone surrogate": f'{{"time": {NOW - 598}, "step": 2, "values": {{"loss\\ud800": "nan"}}, "batch_id": "\\udc00"}}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_LINES))
def test_hostile_lines_are_skipped_or_kept_never_a_traceback(tmp_path: Path, capsys, name: str) -> None:
    record = write(tmp_path / "a.jsonl", [LIVE, live_step(0), HOSTILE_LINES[name], live_step(3)])
    out = tmp_path / "out"
    assert main(["replay", str(record), "--out", str(out)]) == 0
    assert main(["report", str(record), "--out", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert set(steps_of(out)) >= {0, 3}
    assert all(line.startswith("dualtrack ") for line in err.splitlines()), err


def test_names_with_dollars_and_surrogates_are_drawn_as_text(tmp_path: Path, capsys) -> None:
    start = json.dumps({**LIVE, "run": "lr$1e-3$_{x}", "job": "a$b"})[:-1] + ', "instance": "n\\ud800"}'
    record = write(tmp_path / "a.jsonl", [start, live_step(0), live_step(1, batch_id="$\\frac{")])
    page = tmp_path / "r.html"
    assert main(["report", str(record), "--out", str(page), "--png"]) == 0
    assert "a$b/lr$1e-3$_{x}/rank0" in page.read_text()
    out = tmp_path / "out"
    assert main(["replay", str(record), "--out", str(out)]) == 0
    labels = dump(out, "training_step")[0][0]
    assert labels["run"] == "lr$1e-3$_{x}" and labels["instance"] == "n\ufffd"


# -- Hostile folders ------------------------------------------------------------------------------

def test_fifos_devices_and_folders_named_jsonl_are_skipped_and_counted(tmp_path: Path, capsys) -> None:
    records = tmp_path / "records"
    records.mkdir()
    write(records / "good.jsonl", [LIVE, live_step(0), live_step(1)])
    os.mkfifo(records / "pipe.jsonl")  # nobody writes: opening it for reading would block for ever
    (records / "zero.jsonl").symlink_to("/dev/zero")  # no newline, ever: reading it would eat memory
    (records / "folder.jsonl").mkdir()
    out = tmp_path / "out"
    assert main(["replay", str(records), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "3 files that are not regular files (first at folder.jsonl)" in err and err.count("\n") == 1
    assert steps_of(out) == [0, 1]
    assert main(["report", str(records), "--out", str(tmp_path / "r.html")]) == 0
    assert main(["report", "r1", "--records", str(records), "--out", str(tmp_path / "r.html")]) == 0
    capsys.readouterr()
    assert main(["replay", str(records / "pipe.jsonl"), "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"dualtrack replay: error: {records / 'pipe.jsonl'}: not a regular file\n"


def test_a_line_longer_than_the_limit_is_skipped_without_reading_it_whole(tmp_path: Path, capsys,
                                                                          monkeypatch) -> None:
    from dualtrack import records as records_module
    monkeypatch.setattr(records_module, "MAX_LINE_BYTES", 4096)
    record = write(tmp_path / "a.jsonl", [LIVE, live_step(0), '{"pad": "' + "x" * 10_000 + '"}', live_step(1)])
    assert main(["replay", str(record), "--out", str(tmp_path / "out")]) == 0
    assert "1 line longer than 4096 bytes (first at a.jsonl:3)" in capsys.readouterr().err
    assert steps_of(tmp_path / "out") == [0, 1]


# -- Interrupted replays leave no temporary folder ------------------------------------------------

def _slow_replay(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A replay in a child process whose promtool (a stand-in) blocks until killed."""
    started = tmp_path / "promtool-started"
    fake = tmp_path / "promtool"
    fake.write_text(f"#!/bin/sh\necho $$ > {started}.tmp && mv {started}.tmp {started}\nexec sleep 600\n")
    fake.chmod(0o755)
    record = write(tmp_path / "a.jsonl", [LIVE, live_step(0)])
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-m", "dualtrack", "replay", str(record), "--out", str(out),
                              "--promtool", str(fake)], cwd=REPO, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=default_signal_actions)
    wait_until(started.exists, 60, what="promtool to start")
    return child, out, started


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signalled_replay_removes_its_temporary_folder_and_stops_promtool(tmp_path: Path, signum: int,
                                                                             code: int) -> None:
    child, out, started = _slow_replay(tmp_path)
    child.send_signal(signum)
    _, err = child.communicate(timeout=60)
    assert child.returncode == code
    assert err == f"dualtrack replay: error: interrupted by {signal.Signals(signum).name}\n"
    assert [p.name for p in out.iterdir()] == []
    wait_until(lambda: _gone(int(started.read_text())), 30, what="promtool to be stopped")


def test_a_killed_replays_folder_is_removed_by_the_next_one_and_only_that(tmp_path: Path) -> None:
    child, out, started = _slow_replay(tmp_path)
    child.kill()
    child.wait()
    os.kill(int(started.read_text()), signal.SIGKILL)
    left = [p for p in out.iterdir() if p.name.startswith(".dualtrack-replay-")]
    assert len(left) == 1
    unmarked = out / ".dualtrack-replay-notmine"  # no owner file: nothing proves it is stale
    unmarked.mkdir()
    alive = out / ".dualtrack-replay-alive"  # owned by a process that still runs: this one
    alive.mkdir()
    from dualtrack.workspace import OWNER_FILE, owner
    (alive / OWNER_FILE).write_text(json.dumps(owner()))
    record = write(tmp_path / "b.jsonl", [LIVE, live_step(0)])
    assert main(["replay", str(record), "--out", str(out)]) == 0
    assert not left[0].exists() and unmarked.is_dir() and alive.is_dir()
