"""`dualtrack report`: downsampling that keeps spikes, several runs compared, the GPU track from a
real Prometheus scraping the (simulated) exporter, and bad input."""
from __future__ import annotations

import calendar
import os
import re
import time
from pathlib import Path

import pytest

from dualtrack.cli import main
from dualtrack.summary import MAX_BUCKETS, MinMaxSeries
from exporter.simulated import simulated_uuid
from stack import processes
from tests.support import daemons
from tests.support.hook import Trainer, run_id
from tests.support.records import check_html, synthetic_record
from trainer_hook import TrainingMonitor


def test_min_max_downsampling_keeps_a_one_step_spike_and_stays_bounded() -> None:
    series = MinMaxSeries()
    for step in range(200_000):
        series.add(step, 1e6 if step == 123_457 else 1.0 + (step % 7) * 0.01)
    xs, ys = series.points()
    assert len(xs) <= 2 * MAX_BUCKETS
    assert (123_457, 1e6) in zip(xs, ys)
    assert xs == sorted(xs) and min(ys) == 1.0


def test_a_long_run_report_is_bounded_and_several_runs_compare(tmp_path: Path, capsys) -> None:
    long = synthetic_record(tmp_path / "long.jsonl", "long", 30_000, spike_at=20_001)
    short = synthetic_record(tmp_path / "short.jsonl", "short", 500)
    out = tmp_path / "cmp.html"
    assert main(["report", str(long), str(short), "--out", str(out)]) == 0
    page = out.read_text()
    check_html(page)
    assert out.stat().st_size < 1_000_000
    assert "j/long/rank0" in page and "j/short/rank0" in page  # legend and sections
    assert "&lt;b&gt;&amp;&lt;/b&gt;" in page and "<b>&</b>" not in page  # record text is escaped
    for title in ("loss", "grad norm", "learning rate", "data-wait share of step time", "step time (s)"):
        assert f">{title}<" in page
    assert "first-nonfinite" not in page
    assert "wrote" in capsys.readouterr().out


def test_a_run_id_is_looked_up_in_the_records_directory(tmp_path: Path) -> None:
    synthetic_record(tmp_path / "whatever-name.jsonl", "lookup-me", 50)
    synthetic_record(tmp_path / "other.jsonl", "someone-else", 50)
    out = tmp_path / "r.html"
    assert main(["report", "lookup-me", "--records", str(tmp_path), "--out", str(out)]) == 0
    page = out.read_text()
    assert "j/lookup-me/rank0" in page and "someone-else" not in page


def test_unknown_run_or_empty_record_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["report", "no-such-run", "--records", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["report", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "r.html")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing to report" in err and not (tmp_path / "r.html").exists()


def test_an_unreachable_prometheus_still_gives_the_record_report(tmp_path: Path, capsys) -> None:
    record = synthetic_record(tmp_path / "a.jsonl", "a", 100)
    url = f"http://127.0.0.1:{processes.free_port()}"
    assert main(["report", str(record), "--out", str(tmp_path / "r.html"), "--prometheus", url]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the report has the record only" in err
    assert "query failed" in (tmp_path / "r.html").read_text()


@pytest.mark.e2e
def test_gpu_track_and_alerts_section_come_from_prometheus(tmp_path: Path, start_service) -> None:
    exporter = start_service(processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=2"]))
    pgw = start_service(processes.pushgateway(tmp_path))
    config = processes.render_prometheus_config(
        tmp_path, {processes.EXPORTER_JOB: [exporter.address], processes.PUSHGATEWAY_JOB: [pgw.address]},
        scrape_interval="1s", evaluation_interval="1s")
    prometheus = start_service(processes.prometheus(tmp_path, config))
    run = run_id("gpu")
    (tmp_path / "records").mkdir()
    trainer = Trainer()
    with TrainingMonitor(job="gputrack", run=run, pushgateway=pgw.url, push_interval=0.2, rank=0,
                         record_path=tmp_path / "records", gpu_uuid=simulated_uuid(1)) as monitor:
        trainer.train_step(monitor)
        daemons.wait_for_series(prometheus.url, f'training_gpu_info{{run="{run}"}}', 30)
        # Enough scrapes of the exporter while the run's GPU is known: three utilization samples.
        processes.wait_until(lambda: trainer.train_step(monitor) is not None and len(daemons.query(
            prometheus.url, f'nvml_gpu_utilization_ratio{{uuid="{simulated_uuid(1)}"}}[10s]')[0]["values"]) >= 3,
            30, what="three scrapes")
        trainer.train_step(monitor, loss_scale=float("nan"))
        daemons.wait_for_series(prometheus.url, f'ALERTS{{alertname="TrainingLossNonFinite",run="{run}",'
                                                  f'alertstate="firing"}}', 30)
        # The run is live: the report says so, and shows no alert firing later than now (the alert
        # has fired for a few evaluations, so the report's query steps see it).
        daemons.wait_for_series(prometheus.url, f'count_over_time(ALERTS{{alertname="TrainingLossNonFinite",'
                                                  f'run="{run}",alertstate="firing"}}[1m]) >= 3', 30)
        live = tmp_path / "live.html"
        assert main(["report", run, "--records", str(tmp_path / "records"), "--out", str(live),
                     "--prometheus", prometheus.url]) == 0
        written = time.time()
        page = live.read_text()
        assert "died without closing" not in page and f"running (no end line yet; its process {os.getpid()} is " \
            "alive on this host)" in page
        table = page[page.index('<table id="alerts">'):page.index("</table>", page.index('<table id="alerts">'))]
        seen = [calendar.timegm(time.strptime(text, "%Y-%m-%d %H:%M:%S UTC"))
                for text in re.findall(r"<td>(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC)</td>", table)]
        assert seen and max(seen) <= written, f"an alert seen firing after the report was written: {table}"
    out = tmp_path / "gpu.html"
    assert main(["report", run, "--records", str(tmp_path / "records"), "--out", str(out),
                 "--prometheus", prometheus.url, "--png"]) == 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    page = out.read_text()
    check_html(page)
    for title in ("GPU utilization", "GPU memory used (bytes)", "GPU power (W)"):
        assert f">{title}<" in page
    legends = set(re.findall(r"gpu (\d) GPU-", page))
    assert legends == {"1"}  # only the GPU the run trained on, not the other simulated one
    assert f"Prometheus: {prometheus.url}" in page
    alerts = page[page.index('<table id="alerts">'):]
    assert "<td>TrainingLossNonFinite</td>" in alerts and f"run={run}" in alerts
