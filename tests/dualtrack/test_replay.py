"""`dualtrack replay` on bad input and bad flags: a count and one line, never a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dualtrack.cli import main
from tests.support.paths import REPO
from tests.support.records import START, dump, step, write


def test_bad_lines_are_counted_in_one_line_and_the_rest_is_replayed(tmp_path: Path, capsys) -> None:
    other = {**START, "run": "r2", "time": 2000.0}
    record = write(tmp_path / "mixed.jsonl", [
        START, step(0, 1000.5), "{not json", step(1, 1001.0), step(2, 1001.0),  # same ms: kept
        ["a", "list"], {"time": 1002.0, "step": "three", "values": {}},
        other, step(0, 2000.5, values={"loss": "nan"}, nonfinite=["loss"]),
        step(1, 2001.0, values={"loss": "inf"}),
    ], tail='{"time": 2002.0, "st')
    assert main(["replay", str(record), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "replayed 2 run(s) (5 steps" in out
    assert err.count("\n") == 1 and err.startswith("dualtrack replay: skipped ")
    assert "3 corrupt lines (first at mixed.jsonl:3)" in err
    assert "1 run mixed into another run's file (first at mixed.jsonl:8)" in err
    assert "1 truncated last line (first at mixed.jsonl:11)" in err

    losses = dump(tmp_path / "out", "training_loss")
    by_run = {run: [(v, ms) for labels, v, ms in losses if labels["run"] == run] for run in ("r1", "r2")}
    assert by_run["r1"] == [("1", 1000500), ("2", 1001000), ("3", 1001001)]
    assert [v for v, _ in by_run["r2"]] == ["NaN", "+Inf"]
    labels = losses[0][0]
    assert labels == {"__name__": "training_loss", "job": "j", "run": labels["run"], "rank": "0",
                      "instance": "n1", "replayed": "true"}
    info = dump(tmp_path / "out", "training_run_info")[0][0]
    assert info["lr"] == "0.1" and info["config_job"] == "clash" and info["job"] == "j"
    wait = dump(tmp_path / "out", "training_data_wait_seconds_total")
    assert [v for labels, v, _ in wait if labels["run"] == "r1"] == ["0.02", "0.04", "0.06"]
    first = [(labels["run"], v) for labels, v, _ in dump(tmp_path / "out", "training_first_nonfinite_step")]
    assert ("r2", "0") in first and ("r2", "-1") not in first and {v for r, v in first if r == "r1"} == {"-1"}


def test_a_copy_of_a_record_read_twice_adds_nothing(tmp_path: Path, capsys) -> None:
    record = write(tmp_path / "a.jsonl", [START] + [step(n, 1000.0 + n) for n in range(5)])
    copy = write(tmp_path / "copy.jsonl", [START] + [step(n, 1000.0 + n) for n in range(5)])
    assert main(["replay", str(record), str(copy), str(record), "--out", str(tmp_path / "out")]) == 0
    assert len(dump(tmp_path / "out", "training_step")) == 5
    assert "5 repeated or out-of-order step lines (first at j/r1/rank0 step 0)" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("", "nothing to replay: no step lines in {path} (1 empty file (first at empty.jsonl))"),
    ('{"event": "start", "job": "j", "run": "r", "rank": 0, "time": 1}\n',
     "nothing to replay: no step lines in {path}"),
    ("\x00\x01garbage", "nothing to replay: no step lines in {path} (1 truncated last line (first at empty.jsonl:1))"),
])
def test_nothing_to_replay_is_one_line_and_exit_1(tmp_path: Path, capsys, content: str, message: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    assert main(["replay", str(path), "--out", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    assert err == f"dualtrack replay: error: {message.format(path=path.resolve())}\n" and out == ""


def test_missing_promtool_says_how_to_install_it(tmp_path: Path, capsys, monkeypatch) -> None:
    record = write(tmp_path / "a.jsonl", [START, step(0, 1000.0)])
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["replay", str(record), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "promtool not found" in err and "apt-get install prometheus" in err


@pytest.mark.parametrize("argv", [
    ["replay", "a.jsonl"],                      # no --out
    ["replay", "--out", "x"],                   # no record
    ["replay", "a.jsonl", "--out", "x", "--bogus"],
    ["report"],
    ["report", "a.jsonl", "--prometheus"],
    ["nope"],
])
def test_bad_flags_exit_2_with_one_line(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


def test_a_missing_record_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    assert main(["replay", str(tmp_path / "gone.jsonl"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"dualtrack replay: error: {tmp_path / 'gone.jsonl'}: "
                                       "no such record file or directory\n")


def test_each_subcommand_has_help() -> None:
    for command in ("replay", "report"):
        result = subprocess.run([sys.executable, "-m", "dualtrack", command, "--help"], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "--out" in result.stdout and result.stderr == ""


def test_the_top_level_help_speaks_of_commands_not_modules() -> None:
    result = subprocess.run([sys.executable, "-m", "dualtrack", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""
    assert "module" not in result.stdout.lower() and "package" not in result.stdout.lower(), result.stdout
    assert "commands:" in result.stdout and "COMMAND --help" in result.stdout
    for command in ("explain", "janitor", "replay", "report"):
        assert f"    {command} " in result.stdout


def test_the_stack_loads_only_the_blocks_of_a_replay_directory(tmp_path: Path) -> None:
    from stack.demo import load_replayed_blocks, parse_args
    record = write(tmp_path / "a.jsonl", [START] + [step(n, 1000.0 + n) for n in range(3)])
    assert main(["replay", str(record), "--out", str(tmp_path / "replay")]) == 0
    data = tmp_path / "prometheus-data"
    assert load_replayed_blocks(parse_args(["--replay", str(tmp_path / "replay")]).replay, data) == 1
    replayed = [p.name for p in (tmp_path / "replay").iterdir() if p.name.startswith("01")]
    assert [p.name for p in data.iterdir()] == replayed
    assert len(dump(data, "training_step")) == 3


def test_a_failing_promtool_is_one_line_and_leaves_no_partial_blocks(tmp_path: Path, capsys) -> None:
    record = write(tmp_path / "a.jsonl", [START, step(0, 1000.0)])
    fake = tmp_path / "promtool"
    fake.write_text("#!/bin/sh\necho 'parse error: something broke' >&2\nexit 1\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    assert main(["replay", str(record), "--out", str(out), "--promtool", str(fake)]) == 1
    err = capsys.readouterr().err
    assert err == "dualtrack replay: error: promtool could not build blocks (exit 1): parse error: something broke\n"
    assert list(out.iterdir()) == []
    assert main(["replay", str(record), "--out", str(out), "--promtool", str(tmp_path / "a.jsonl")]) == 1
    assert "not an executable" in capsys.readouterr().err


def test_format_2_fields_become_their_live_series(tmp_path: Path) -> None:
    record = write(tmp_path / "fp16.jsonl", [
        {**START, "local_rank": 1, "world_size": 8},
        step(0, 1000.0, loss_scale=65536.0, cuda={"allocated": 1024, "reserved": 4096}),
        # The GradScaler skipped this step: its infinite grad norm is an overflow, not a divergence.
        step(1, 1000.1, loss_scale=32768.0, skipped="overflow", values={"loss": 1.5, "grad_norm": "inf"}),
        step(2, 1000.2, loss_scale=32768.0, cuda={"allocated": 2048, "reserved": 4096},
             values={"loss": "nan", "grad_norm": 2.0}, nonfinite=["loss"]),
        step(3, 1000.3, skipped="overflow", values={"loss": "nan", "grad_norm": "inf"}, nonfinite=["loss"]),
        step(4, 1000.4, skipped="overflow", values={"loss": 1.0, "grad_norm": "inf"}),
        step(5, 1000.5, values={"loss": "nan"}),
        {"event": "end", "time": 1000.6, "state": "finished", "steps": 6},
    ])
    out = tmp_path / "out"
    assert main(["replay", str(record), "--out", str(out)]) == 0

    def values(metric: str) -> list[float]:
        return [float(v) for _, v, _ in dump(out, metric)]

    assert values("training_loss_scale") == [65536, 32768, 32768]
    assert values("training_skipped_steps_total") == [0, 1, 1, 2, 3, 3]  # 0 until a skip, as live
    assert values("training_cuda_memory_allocated_bytes") == [1024, 2048]
    assert values("training_world_size")[-1] == 8 and values("training_local_rank")[-1] == 1
    assert values("training_grad_norm") == [2.0]  # overflows leave the gauge as it was
    assert values("training_nonfinite_steps_total") == [0, 0, 1, 2, 2, 3]
    # The streak that starts at step 2 goes on through the skipped steps 3 and 4 to step 5.
    assert values("training_first_nonfinite_step")[-1] == 2
    assert values("training_last_nonfinite_step")[-1] == 5
    states = {labels["state"]: float(v) for labels, v, _ in dump(out, "training_run_state")}  # last of each
    assert states == {"running": 0, "finished": 1, "failed": 0}
    counts = dump(out, "training_logged_value_count")
    assert [float(v) for labels, v, _ in counts if labels["key"] == "loss"] == [1, 2, 2, 2, 3, 3]  # finite only
    # A key's series come at the steps that change them (the overflows of steps 1, 3, 4 do not).
    assert [float(v) for labels, v, _ in counts if labels["key"] == "grad_norm"] == [1]


def test_a_run_that_failed_of_an_exception_replays_its_class(tmp_path: Path) -> None:
    """As the live hook pushes it (training_run_failure_info), so the replayed run's OOM is visible."""
    record = write(tmp_path / "oom.jsonl", [
        START, step(0, 1000.0), step(1, 1000.1),
        {"event": "end", "time": 1000.2, "state": "failed", "steps": 2, "reason": "OutOfMemoryError",
         "message": "CUDA out of memory."},
    ])
    out = tmp_path / "out"
    assert main(["replay", str(record), "--out", str(out)]) == 0
    assert [(labels["reason"], float(v)) for labels, v, _ in dump(out, "training_run_failure_info")] == [
        ("OutOfMemoryError", 1.0)]
