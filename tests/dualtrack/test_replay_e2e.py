"""A real training run crashes (NaN, then an exception); its record is replayed into a real
Prometheus and turned into a post-mortem report."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from dualtrack.cli import main
from stack import processes
from tests.support import daemons
from tests.support.hook import Trainer, record_lines, run_id
from tests.support.records import check_html
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.e2e
FIRST_NAN = 30
CRASH_AFTER = 40


def crashed_run(record_dir: Path) -> tuple[str, Path]:
    """Train a tiny model; the loss turns NaN at FIRST_NAN, an exception ends the run later."""
    run = run_id("crash")
    record_dir.mkdir()
    trainer = Trainer()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        with TrainingMonitor(job="postmortem", run=run, pushgateway=False, rank=0, record_path=record_dir,
                             push_interval=0.05, config={"lr": 0.01, "model": "mlp"}) as monitor:
            while True:
                trainer.train_step(monitor, loss_scale=math.nan if trainer.step >= FIRST_NAN else 1.0)
                if trainer.step > CRASH_AFTER:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return run, record_dir / f"postmortem-{run}-rank0.jsonl"


def range_values(url: str, expr: str, at: float) -> list[tuple[float, str]]:
    result = daemons.query(url, f"{expr}[1h]", at=at)
    assert len(result) == 1, result
    return [(float(t), v) for t, v in result[0]["values"]]


def test_a_crashed_run_replays_at_step_resolution_and_reports(tmp_path: Path, start_service, capsys) -> None:
    run, record = crashed_run(tmp_path / "records")
    steps, events = record_lines(record)
    assert len(steps) == CRASH_AFTER + 1 and events[-1]["state"] == "failed"
    data = tmp_path / "prometheus-data"
    # Replayed twice: the second replay replaces the first one's blocks.
    for _ in range(2):
        assert main(["replay", str(record), "--out", str(data)]) == 0
    blocks = json.loads((data / "dualtrack-replay.json").read_text())["blocks"]
    assert [[(r["job"], r["run"], r["rank"], r["steps"]) for r in entry["runs"]] for entry in blocks.values()] == [
        [("postmortem", run, "0", CRASH_AFTER + 1)]]
    assert "replayed 1 run(s) (41 steps" in capsys.readouterr().out

    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1h}\n")
    prometheus = start_service(processes.prometheus(tmp_path, config))
    end = events[-1]["time"] + 1
    selector = f'{{job="postmortem",run="{run}",rank="0",replayed="true"}}'

    losses = range_values(prometheus.url, "training_loss" + selector, end)
    expected = ["NaN" if isinstance(s["values"]["loss"], str) else s["values"]["loss"] for s in steps]
    assert [v if v == "NaN" else float(v) for _, v in losses] == expected
    assert [t for t, _ in losses] == sorted({t for t, _ in losses})  # one sample per step, in order
    assert abs(losses[0][0] - steps[0]["time"]) < 0.01 and abs(losses[-1][0] - steps[-1]["time"]) < 0.05
    step_values = range_values(prometheus.url, "training_step" + selector, end)
    assert [int(float(v)) for _, v in step_values] == list(range(CRASH_AFTER + 1))

    first = daemons.query(prometheus.url, "training_first_nonfinite_step" + selector, at=end)
    assert float(first[0]["value"][1]) == FIRST_NAN
    before_nan = daemons.query(prometheus.url, "training_first_nonfinite_step" + selector,
                                 at=losses[FIRST_NAN - 1][0])  # the sample time of the step before
    assert float(before_nan[0]["value"][1]) == -1
    nonfinite = daemons.query(prometheus.url, "training_nonfinite_steps_total" + selector, at=end)
    assert float(nonfinite[0]["value"][1]) == CRASH_AFTER + 1 - FIRST_NAN
    failed = daemons.query(prometheus.url, f'training_run_state{{run="{run}",state="failed"}}', at=end)
    assert float(failed[0]["value"][1]) == 1
    info = daemons.query(prometheus.url, f'training_run_info{{run="{run}"}}', at=end)
    assert info[0]["metric"]["model"] == "mlp"
    assert daemons.query(prometheus.url, f'training_loss{{run="{run}",replayed=""}}', at=end) == []

    report = tmp_path / "report.html"
    assert main(["report", str(record), "--out", str(report), "--png",
                 "--prometheus", prometheus.url]) == 0
    page = report.read_text()
    check_html(page)
    assert f'data-step="{FIRST_NAN}"' in page and f"first non-finite step {FIRST_NAN}, batch {FIRST_NAN}" in page
    assert page.count("<svg") == 1 and "<script" not in page and "src=" not in page
    message = events[-1].get("message")  # the exception's message, where the hook records it
    assert "RuntimeError" + (f": {message}" if message else "") in page
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_record_split_into_many_chunks_loses_and_doubles_nothing(tmp_path: Path, start_service,
                                                                  monkeypatch) -> None:
    from dualtrack import replay
    monkeypatch.setattr(replay, "CHUNK_SAMPLES", 2000)  # ~250 steps per promtool run: 8+ chunks
    start = time.time() - 600
    record = tmp_path / "chunked.jsonl"
    with open(record, "w") as out:
        out.write(json.dumps({"event": "start", "format": 2, "time": start, "job": "chunks", "run": "c1",
                              "rank": 0, "instance": "n1", "config": {}}) + "\n")
        for n in range(2000):
            out.write(json.dumps({"time": start + n * 0.1, "step": n, "samples": 1, "duration_seconds": 0.1,
                                  "values": {"loss": float(n)}}) + "\n")
    data = tmp_path / "prometheus-data"
    assert main(["replay", str(record), "--out", str(data)]) == 0
    assert len(json.loads((data / "dualtrack-replay.json").read_text())["blocks"]) >= 8
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1h}\n")
    prometheus = start_service(processes.prometheus(tmp_path, config))
    at = start + 200
    losses = range_values(prometheus.url, 'training_loss{run="c1"}', at)
    assert [float(v) for _, v in losses] == [float(n) for n in range(2000)]
    total = daemons.query(prometheus.url, 'training_steps_total{run="c1"}', at=at)
    assert float(total[0]["value"][1]) == 2000
