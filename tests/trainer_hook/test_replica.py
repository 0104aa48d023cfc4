"""Replica comparison under DDP: the verdict on gathered norms, and three real gloo ranks (torchrun)
pushing their counts to a real Pushgateway while rank 2's gradient is corrupted after the all-reduce."""
from __future__ import annotations

import pytest

from stack import processes
from tests.support.distributed import finish, torchrun
from tests.support.hook import pushed_value, run_id
from trainer_hook.replica import outvoted


def test_the_rank_outside_the_majority_is_outvoted_and_a_tie_outvotes_everyone():
    a, b = 1.5571, 1.5571 + 2 ** -40
    assert [outvoted([a, a, b], me) for me in range(3)] == [False, False, True]
    assert [outvoted([a, a, a], me) for me in range(3)] == [False, False, False]
    assert [outvoted([a, b], me) for me in range(2)] == [True, True]  # two replicas: no majority
    assert [outvoted([a, a, b, b], me) for me in range(4)] == [True] * 4
    nan = float("nan")
    assert [outvoted([nan, nan, a], me) for me in range(3)] == [False, False, True]  # NaNs compared bit for bit


@pytest.mark.e2e
def test_a_corrupted_replica_counts_divergent_steps_and_its_peers_none(tmp_path, start_service):
    pgw = start_service(processes.pushgateway(tmp_path))
    run = run_id("sdc")
    proc = torchrun("corrupt", tmp_path, run, pgw.url)

    def compared() -> list[float | None]:
        return [pushed_value(pgw.url, "training_replica_compared_steps_total", run, rank=str(rank))
                for rank in range(3)]

    try:
        processes.wait_until(lambda: all(n is not None and n >= 3 for n in compared()), 120,
                             what="three comparisons on every rank")
    finally:
        (tmp_path / "stop").touch()
    finish(proc, tmp_path, timeout=60)
    counts = compared()
    divergent = [pushed_value(pgw.url, "training_replica_divergent_steps_total", run, rank=str(rank))
                 for rank in range(3)]
    assert divergent[:2] == [0, 0]
    assert divergent[2] == counts[2] >= 3
    assert "differs from its data-parallel peers'" in (tmp_path / "torchrun-corrupt.log").read_text()
