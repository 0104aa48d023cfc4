"""Goodput counts what was wasted: a real CPU run non-finite at one step in three, pushed to a real
Pushgateway and scraped by a real Prometheus evaluating the shipped rules; `dualtrack report` shows its
goodput near 2/3 (not 100 %) and what it lost to non-finite steps."""
from __future__ import annotations

import re

import pytest

from dualtrack.cli import main
from stack import processes
from tests.support import daemons
from tests.support.hook import Trainer, run_id
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.e2e


def test_a_run_nan_one_step_in_three_has_two_thirds_goodput_in_the_report(tmp_path, start_service):
    pgw = start_service(processes.pushgateway(tmp_path))
    config = processes.render_prometheus_config(tmp_path, {processes.PUSHGATEWAY_JOB: [pgw.address]},
                                                scrape_interval="1s", evaluation_interval="1s")
    prometheus = start_service(processes.prometheus(tmp_path, config))
    run = run_id("nan-third")
    records = tmp_path / "records"
    records.mkdir()
    recorded = f'count_over_time(job_run:training_goodput:ratio_rate5m{{run="{run}"}}[1m]) >= 8'
    with TrainingMonitor(job="goodput", run=run, pushgateway=pgw.url, push_interval=0.2,
                         record_path=records) as monitor:
        trainer = Trainer()

        def train_three() -> list:
            trainer.train_step(monitor)
            trainer.train_step(monitor)
            trainer.train_step(monitor, loss_scale=float("nan"))  # the optimizer skips it; the step is lost
            return daemons.query(prometheus.url, recorded)
        processes.wait_until(train_three, 60, interval=0.1, what="8 evaluations of the run's goodput")
    out = tmp_path / "goodput.html"
    assert main(["report", run, "--records", str(records), "--out", str(out), "--prometheus", prometheus.url]) == 0
    page = out.read_text()
    row = page[page.index('<table id="goodput">'):].split("</tr>")[1]
    cells = re.findall(r"<td>([^<]*)</td>", row)
    goodput = float(cells[1].rstrip("%")) / 100
    assert 0.5 < goodput <= 0.7, cells  # two steps in three counted (rates over a few seconds wobble)
    lost = dict(re.findall(r"(\w[\w ]*) (\d+\.\d)%", cells[2]))
    assert 25 <= float(lost["nonfinite"]) <= 45, cells
