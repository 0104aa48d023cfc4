"""explain's PromQL selectors (dualtrack/explain/promql.py): a label value is a quoted PromQL string,
whatever it holds, and a real Prometheus selects by it exactly the series that carries it."""
from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from dualtrack.explain.promql import matchers, not_equal, one_of, quote, selector, window
from tests.support import daemons
from tests.support import explain as explain_support

#: Run ids nobody should choose, and somebody will.
HOSTILE = ('say "hi"', "back\\slash", "new\nline", 'all \\" of\n them\\', 'x",job="other', "a.b|c*", "}{ ]")


def test_a_selector_writes_each_label_quoted() -> None:
    assert selector("training_loss", run="r1", rank="0") == 'training_loss{run="r1",rank="0"}'
    assert selector("training_step") == "training_step"
    assert selector("", run="r1") == '{run="r1"}'
    assert selector("training_step", run="r1", rank=None) == 'training_step{run="r1"}'  # None: any rank
    assert selector("up", 'job="a"', state=not_equal("")) == 'up{job="a",state!=""}'
    assert matchers(uuid=one_of(["GPU-1.0", "GPU-2"])) == 'uuid=~"GPU\\\\-1\\\\.0|GPU\\\\-2"'
    assert window(3600) == "1h" and window(1800) == "30m" and window(120) == "2m" and window(90) == "90s"


def test_quotes_escape_backslash_double_quote_and_newline() -> None:
    assert quote('say "hi"') == '"say \\"hi\\""'
    assert quote("back\\slash") == '"back\\\\slash"'
    assert quote("new\nline") == '"new\\nline"'
    assert quote('\\"') == '"\\\\\\""'  # the backslash first, or the quote's own escape would be doubled
    assert quote("tab\tand é") == '"tab\tand é"'  # what PromQL reads as is stays as is


def openmetrics(value: str) -> str:
    """A label value as the OpenMetrics text writes it (the spec's three escapes, apart from the code tested)."""
    return value.replace("\\", r"\\").replace('"', r'\"').replace("\n", r"\n")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus holding one series `t` per HOSTILE run id, valued with its index."""
    work = tmp_path_factory.mktemp("promql")
    at = time.time() // 60 * 60 - 600
    lines = [f't{{run="{openmetrics(run)}"}} {i} {at:.0f}' for i, run in enumerate(HOSTILE)]
    (work / "series.om").write_text("\n".join(lines) + "\n# EOF\n")
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(work / "series.om"),
                    str(work / "prometheus-data")], check=True, capture_output=True, timeout=120)
    with explain_support.serving(work) as url:
        yield url


@pytest.mark.e2e
def test_prometheus_selects_exactly_the_run_a_selector_names(prometheus: str) -> None:
    """Each hostile run id, by equality and as a literal alternative of a regex, selects its own series
    and no other (a quote left unescaped would select none, or end the string and match another label)."""
    for i, run in enumerate(HOSTILE):
        for wanted in (run, one_of([run])):
            found = daemons.query(prometheus, f"last_over_time({selector('t', run=wanted)}[1h])")
            assert [(s["metric"]["run"], s["value"][1]) for s in found] == [(run, str(i))], run
    both = daemons.query(prometheus, f"last_over_time({selector('t', run=one_of(HOSTILE[:2]))}[1h])")
    assert sorted(s["metric"]["run"] for s in both) == sorted(HOSTILE[:2])
