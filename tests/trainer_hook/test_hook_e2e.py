"""trainer_hook through a real Pushgateway and a real Prometheus (honor_labels) with real torch training."""
from __future__ import annotations

import logging
import socket
import threading

import pytest

from stack import processes
from tests.support import daemons
from tests.support.hook import Trainer, record_lines, run_id
from trainer_hook import TrainingMonitor

pytestmark = pytest.mark.e2e


@pytest.fixture
def stack(tmp_path, start_service):
    """A Pushgateway and a Prometheus scraping it every second."""
    pgw = start_service(processes.pushgateway(tmp_path))
    config = processes.render_prometheus_config(tmp_path, {processes.PUSHGATEWAY_JOB: [pgw.address]},
                                                scrape_interval="1s", evaluation_interval="1s")
    prom = start_service(processes.prometheus(tmp_path, config))
    return pgw, prom


def value(prom, expr: str) -> float:
    result = daemons.query(prom.url, expr)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


def wait_value(prom, expr: str, predicate, timeout: float = 20.0) -> float:
    result = daemons.wait_for_series(prom.url, expr, timeout,
                                       lambda r: len(r) == 1 and predicate(float(r[0]["value"][1])))
    return float(result[0]["value"][1])


def test_values_reach_prometheus_with_job_run_rank_and_instance(stack, tmp_path):
    pgw, prom = stack
    run = run_id("e2e")
    trainer = Trainer()
    with TrainingMonitor(job="hooktest", run=run, pushgateway=pgw.url, push_interval=0.5,
                         config={"learning_rate": 0.01, "batch_size": 64, "note": 'say "hi"\nthere'},
                         record_path=tmp_path / "r.jsonl") as monitor:
        for _ in range(50):
            trainer.train_step(monitor)
        selector = f'{{job="hooktest",run="{run}",rank="0",instance="{socket.gethostname()}"}}'
        wait_value(prom, f"training_steps_total{selector}", lambda v: v == 50)
        last = record_lines(tmp_path / "r.jsonl")[0][-1]
        assert value(prom, f"training_loss{selector}") == pytest.approx(last["values"]["loss"])
        assert value(prom, f"training_step{selector}") == 49
        assert value(prom, f"training_samples_total{selector}") == 50 * 64
        assert value(prom, f'training_run_state{{run="{run}",state="running"}}') == 1
        assert value(prom, f"training_step_duration_seconds_count{selector}") == 49
        info = daemons.query(prom.url, f'training_run_info{{run="{run}"}}')[0]["metric"]
        assert (info["learning_rate"], info["batch_size"], info["note"]) == ("0.01", "64", 'say "hi" there')
    wait_value(prom, f'training_run_state{{run="{run}",state="finished"}}', lambda v: v == 1)
    assert value(prom, f'training_run_state{{run="{run}",state="running"}}') == 0


def test_explosion_shows_in_the_window_max_and_nonfinite_step_with_a_long_push_interval(stack, tmp_path):
    """~100 steps per push: the one-step spike and the NaN step must both be visible anyway."""
    pgw, prom = stack
    run = run_id("boom")
    trainer = Trainer()
    spike_step, nan_step = 150, 260
    with TrainingMonitor(job="hooktest", run=run, pushgateway=pgw.url, push_interval=1.0,
                         record_path=tmp_path / "r.jsonl") as monitor:
        stop = threading.Event()
        for step in range(300):
            scale = 1e6 if step == spike_step else float("nan") if step == nan_step else 1.0
            trainer.train_step(monitor, loss_scale=scale, batch_id=1000 + step)
            stop.wait(0.01)  # pacing: ~300 steps over ~3 s, i.e. ~3 pushes
        sel = f'{{run="{run}"}}'
        wait_value(prom, f"training_steps_total{sel}", lambda v: v == 300)
    steps, _ = record_lines(tmp_path / "r.jsonl")
    spike_norm = steps[spike_step]["values"]["grad_norm"]
    normal = max(x["values"]["grad_norm"] for x in steps if x["step"] != spike_step
                 and isinstance(x["values"]["grad_norm"], float))
    assert spike_norm > 1000 * normal
    seen_max = wait_value(prom, f"max_over_time(training_grad_norm_max{sel}[5m])", lambda v: v > 1000 * normal)
    assert seen_max == pytest.approx(spike_norm)
    wait_value(prom, f"training_last_nonfinite_step{sel}", lambda v: v == nan_step)
    assert value(prom, f"training_last_nonfinite_batch_id{sel}") == 1000 + nan_step
    assert value(prom, f"training_nonfinite_steps_total{sel}") == 1
    assert steps[nan_step]["nonfinite"] == ["loss", "grad_norm"]


def test_pushgateway_killed_and_restarted_empty_mid_run(stack, tmp_path, caplog):
    pgw, prom = stack
    run = run_id("restart")
    trainer = Trainer()
    pacing = threading.Event()
    with caplog.at_level(logging.WARNING, logger="trainer_hook"), \
            TrainingMonitor(job="hooktest", run=run, pushgateway=pgw.url, push_interval=0.3,
                            push_timeout=1.0, record_path=tmp_path / "r.jsonl") as monitor:
        sel = f'{{run="{run}"}}'
        for _ in range(100):
            trainer.train_step(monitor)
            pacing.wait(0.005)
        wait_value(prom, f"training_steps_total{sel}", lambda v: v >= 50)
        pgw.kill()
        for _ in range(300):  # ~2.5 s of training with the Pushgateway gone
            trainer.train_step(monitor)
            pacing.wait(0.005)
        restarter = threading.Thread(target=pgw.start)  # comes back empty (no persistence)
        restarter.start()
        while restarter.is_alive():
            trainer.train_step(monitor)
            pacing.wait(0.005)
        for _ in range(100):
            trainer.train_step(monitor)
            pacing.wait(0.005)
        total = trainer.step
        wait_value(prom, f"training_steps_total{sel}", lambda v: v == total)  # current values again
        assert value(prom, f"training_push_failures_total{sel}") >= 1
        assert value(prom, f'training_run_state{{run="{run}",state="running"}}') == 1
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert [x["step"] for x in steps] == list(range(total))
    outage_warnings = [r for r in caplog.records if "training continues" in r.getMessage()]
    assert len(outage_warnings) == 1, [r.getMessage() for r in caplog.records]
    assert any("works again" in r.getMessage() for r in caplog.records)
    wait_value(prom, f'training_run_state{{run="{run}",state="finished"}}', lambda v: v == 1)


def test_rate_of_sum_over_rate_of_count_is_the_exact_mean_of_the_logged_values(stack, tmp_path):
    """Whatever the push and scrape intervals, the PromQL mean over a range equals the mean of the
    finite values logged in it (the local record), NaN steps excluded."""
    pgw, prom = stack
    run = run_id("mean")
    trainer = Trainer()
    sel = f'key="loss",run="{run}"'
    with TrainingMonitor(job="hooktest", run=run, pushgateway=pgw.url, push_interval=0.3,
                         record_path=tmp_path / "r.jsonl") as monitor:
        # Train until Prometheus holds 10 s of a growing count (~10 scrapes, ~30 pushes).
        while not (trainer.step % 50 == 0 and daemons.query(
                prom.url, f"count_over_time(training_logged_value_count{{{sel}}}[10s]) >= 10")):
            trainer.train_step(monitor, loss_scale=float("nan") if trainer.step % 97 == 5 else 1.0)
        at = daemons.query(prom.url, f"timestamp(training_logged_value_count{{{sel}}})")[0]["value"][1]
    window = "4s"
    samples = daemons.query(prom.url, f"training_logged_value_count{{{sel}}}[{window}]", at=at)[0]["values"]
    first, last = int(float(samples[0][1])), int(float(samples[-1][1]))
    # A real window, away from the series' start (where rate() would clamp its extrapolation at 0).
    assert last - first > 20 and 2 * first > last - first
    query = (f"rate(training_logged_value_sum{{{sel}}}[{window}]) / "
             f"rate(training_logged_value_count{{{sel}}}[{window}])")
    mean = float(daemons.query(prom.url, query, at=at)[0]["value"][1])
    steps, _ = record_lines(tmp_path / "r.jsonl")
    finite = [x["values"]["loss"] for x in steps if isinstance(x["values"]["loss"], float)]
    assert len(finite) < len(steps)  # NaN steps were logged, and are not in the count
    expected = sum(finite[first:last]) / (last - first)
    assert mean == pytest.approx(expected, rel=1e-6)
    assert mean != pytest.approx(finite[last - 1], rel=1e-6)  # not just the last value
    wait_value(prom, f'training_nonfinite_values_total{{{sel}}}', lambda v: v == len(steps) - len(finite))
