"""explain's table of causes (dualtrack/explain/causes.py CAUSES): every cause kind has a row, a query
Prometheus accepts, a score from dualtrack/thresholds.py and a verdict; a row of an unknown kind, or
explaining an unknown event, is refused when the table is built."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from dualtrack import thresholds as limits
from dualtrack.explain.causes import CAUSES, Counter, Finding, Probe, Search, counter_query
from dualtrack.explain.events import KINDS
from dualtrack.explain.model import Event
from dualtrack.prometheus import QueryError
from tests.support import daemons
from tests.support import explain as explain_support

#: A search that every row can ask: a rank's whole GPU and a MIG instance of another.
SEARCH = Search(Event("failed", 10, 1000.0, "0", "GPU-a", ""), 'run="r"', ["GPU-a", "GPU-b"], "GPU-a", ["GPU-a"],
                [("GPU-b", "1")], {"GPU-a": "0", "GPU-b": "1"}, 400.0, 1015.0, 15.0)


def probe(**overrides: object) -> Probe:
    """A probe row like the table's clock_drop, with `overrides`."""
    fields: dict[str, object] = {"kind": "clock_drop", "query": lambda search: "vector(1)",
                                 "read": lambda search, answer: [], "explains": frozenset({"straggler"}),
                                 "evidence": "e", "phrase": "p"}
    return Probe(**{**fields, **overrides})  # type: ignore[arg-type]


def test_every_cause_kind_has_a_row_a_score_and_a_verdict() -> None:
    kinds = {row.kind for row in CAUSES}
    assert kinds == set(limits.SCORES) | {"data_wait"}
    for row in CAUSES:
        scores = [row.score(Finding({"share": limits.DATA_WAIT_SHARE}, severe)) if row.score else
                  limits.score(row.kind, severe) for severe in (True, False)]
        assert all(0 < score <= 1 for score in scores), row.kind
        assert row.verdict and row.explains <= KINDS and row.evidence and row.phrase
        assert {other.verdict for other in CAUSES if other.kind == row.kind} == {row.verdict}
    assert set().union(*(row.explains for row in CAUSES)) == KINDS  # every event kind can be explained


def test_every_row_can_be_asked_in_a_full_search() -> None:
    for row in CAUSES:
        assert row.needs(SEARCH), row.kind
        if isinstance(row, Probe):
            assert row.query(SEARCH), row.kind
        else:
            assert isinstance(row, Counter) and row.series.startswith("nvml_") and row.series in counter_query(
                SEARCH, [row.series])


def test_a_row_of_an_unknown_kind_or_event_is_refused() -> None:
    assert probe().kind == "clock_drop"
    with pytest.raises(ValueError, match="'cosmic_ray' has no score"):
        probe(kind="cosmic_ray")
    assert probe(kind="cosmic_ray", score=lambda found: 0.5).kind == "cosmic_ray"  # its own score
    with pytest.raises(ValueError, match="not event kinds"):
        probe(explains=frozenset({"straggler", "solar_flare"}))
    with pytest.raises(ValueError, match="not event kinds"):
        probe(explains=frozenset())


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real, empty Prometheus: it parses the queries."""
    with explain_support.serving(tmp_path_factory.mktemp("causes")) as url:
        yield url


@pytest.mark.e2e
def test_prometheus_accepts_every_rows_query(prometheus: str) -> None:
    """A query Prometheus cannot parse is an HTTP 400 (QueryError): every row's query, and the
    counters' selector, parse and find nothing on an empty server."""
    for row in CAUSES:
        if isinstance(row, Probe):
            assert daemons.query(prometheus, row.query(SEARCH)) == [], row.kind
    counters = [row.series for row in CAUSES if isinstance(row, Counter)]
    assert daemons.query(prometheus, counter_query(SEARCH, counters)) == []
    with pytest.raises(QueryError):
        daemons.query(prometheus, probe(query=lambda search: "rate(x[5m]").query(SEARCH))
