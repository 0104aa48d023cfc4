"""The Pushgateway's stated ceiling (trainer_hook.push.PUSHGATEWAY_MAX_RANKS, docs/scaling.md): the hook
warns a run past it, once, naming remote write; at the ceiling the shipped gateway lands 99 % of pushes
within one push interval (slow)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from tests.support.hook import run_id
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor
from trainer_hook.settings import PUSHGATEWAY_MAX_RANKS, pushgateway_interval

sys.path.insert(0, str(REPO / "bench"))
import bench_pushgateway


def ceiling_warnings(caplog, monkeypatch, tmp_path: Path, world_size: int) -> list[str]:
    """The warnings of a run launched (as torchrun says) with `world_size` ranks, pushing."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer_hook"):
        with TrainingMonitor(job="ceiling", run=run_id("ceiling"), pushgateway="http://127.0.0.1:9",
                             push_interval=0.1, record_path=tmp_path / f"{world_size}.jsonl",
                             delete_after=None) as monitor:
            monitor.log({"loss": 1.0}, step=1)
            monitor.log({"loss": 0.9}, step=2)
    return [r.getMessage() for r in caplog.records if "Pushgateway carries" in r.getMessage()]


def test_a_run_past_the_ceiling_is_told_once_to_use_remote_write(caplog, monkeypatch, tmp_path) -> None:
    [warning] = ceiling_warnings(caplog, monkeypatch, tmp_path, PUSHGATEWAY_MAX_RANKS + 1)
    assert f"this run has {PUSHGATEWAY_MAX_RANKS + 1} ranks, past the {PUSHGATEWAY_MAX_RANKS}" in warning
    assert "remote-write receiver" in warning and "DUALTRACK_REMOTE_WRITE_URL" in warning
    assert ceiling_warnings(caplog, monkeypatch, tmp_path, PUSHGATEWAY_MAX_RANKS) == []


def test_large_runs_push_less_often_to_a_pushgateway_up_to_the_scrape_interval(monkeypatch, tmp_path) -> None:
    """The default interval: 5 s up to 100 ranks, then 5 s x (ranks / 100)^2, at most 15 s; a run that
    sets its own, or writes only to a remote-write receiver, keeps its interval."""
    def interval(world_size: int, **kwargs) -> float:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monitor = TrainingMonitor(job="interval", run=run_id("interval"), record_path=False, **kwargs)
        monitor.close()
        return monitor.settings.push_interval
    gateway = {"pushgateway": "http://127.0.0.1:9", "delete_after": None}
    assert [interval(n, **gateway) for n in (1, 100, 150, 1000)] == [5.0, 5.0, 11.25, 15.0]
    assert interval(150, push_interval=2.0, **gateway) == 2.0
    assert pushgateway_interval(PUSHGATEWAY_MAX_RANKS) <= 15.0


def test_the_docs_state_the_ceiling_the_hook_warns_at() -> None:
    scaling = " ".join((REPO / "docs" / "scaling.md").read_text().split())
    assert f"up to {PUSHGATEWAY_MAX_RANKS} ranks" in scaling and "pushes land within one push interval" in scaling


@pytest.mark.slow
@pytest.mark.e2e
def test_the_shipped_gateway_holds_its_stated_ceiling(tmp_path, monkeypatch) -> None:
    """PUSHGATEWAY_MAX_RANKS ranks pushing the hook's payload at the hook's default interval for that
    many: at least 99 % land within one push interval."""
    interval = pushgateway_interval(PUSHGATEWAY_MAX_RANKS)  # the hook's default for that many ranks
    monkeypatch.setattr(bench_pushgateway, "PUSH_INTERVAL", interval)  # the forked load generators see it
    figures = bench_pushgateway.run_load(PUSHGATEWAY_MAX_RANKS, seconds=3 * interval, workers=2,
                                         payload=bench_pushgateway.hook_payload(), workdir=tmp_path)
    assert figures["on_time_pct"] >= 99, figures
