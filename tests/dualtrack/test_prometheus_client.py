"""The Prometheus client of `dualtrack explain` and `report` against servers that misbehave on the
wire (tests/support/hostile_http.py): the real commands, run as a user runs them, end with one line on
stderr and no traceback, within the client's deadline; and goodput asks for the run it is given."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from urllib.parse import parse_qs, urlsplit

import pytest

from dualtrack import goodput, prometheus
from dualtrack.cli import build_parser, main
from tests.support import hostile_http as hostile
from tests.support.paths import REPO
from trainer_hook.connection import resolve

#: server behaviour -> what the one error line names.
FAULTS = {
    "trickle": "no complete answer within 1 s",
    "huge": "an answer over 32 MiB",
    "declared_huge": "an answer over 32 MiB",
    "bad_status_line": "BadStatusLine: SPAM \\x1b[31mSPAM\\r\\n",
    "truncated": "IncompleteRead",
    "disconnect": "RemoteDisconnected",
    "silent": "within 1 s",
    "tls_to_plain": "[SSL",  # https:// to a server that answers in plain HTTP
}


def dualtrack(*argv: str) -> subprocess.CompletedProcess:
    """`dualtrack ARGV` as a user runs it (no Prometheus from the environment); a hang fails the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUALTRACK_")}
    return subprocess.run([sys.executable, "-m", "dualtrack", *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


@pytest.mark.parametrize("fault", FAULTS)
def test_explain_gets_one_line_from_a_misbehaving_server(fault):
    answer = hostile.empty_vector if fault == "tls_to_plain" else getattr(hostile, fault)
    with hostile.RawServer(answer, read_request=fault != "tls_to_plain") as server:
        url = server.url.replace("http://", "https://") if fault == "tls_to_plain" else server.url
        result = dualtrack("explain", "r1", "--prometheus", url, "--prometheus-timeout", "1")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    # explain's first query asks for the run's launches (a range query)
    assert result.stderr.startswith(f"dualtrack explain: error: {url}: query failed (query_range): ")
    assert FAULTS[fault] in result.stderr


@pytest.mark.parametrize("fault", ["trickle", "truncated"])
def test_report_keeps_the_record_when_the_server_misbehaves(fault, tmp_path):
    now = time.time()
    record = tmp_path / "r1.jsonl"
    record.write_text("\n".join(json.dumps(line) for line in [
        {"event": "start", "format": 2, "time": now - 300, "job": "train", "run": "r1", "rank": 0, "config": {}},
        *({"time": now - 200 + n, "step": n, "values": {"loss": 1.0 / n}} for n in range(1, 4))]) + "\n")
    with hostile.RawServer(getattr(hostile, fault)) as server:
        result = dualtrack("report", str(record), "--out", str(tmp_path / "report.html"),
                           "--prometheus", server.url, "--prometheus-timeout", "1")
    assert result.returncode == 0 and (tmp_path / "report.html").is_file()
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"dualtrack report: warning: {server.url}: query failed (query")
    assert FAULTS[fault] in result.stderr and "the report has the record only" in result.stderr


def test_a_bad_timeout_gets_one_line(capsys):
    for value in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as exited:
            main(["explain", "r1", "--prometheus", "http://127.0.0.1:9", f"--prometheus-timeout={value}"])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1 and "--prometheus-timeout" in err, err


def test_the_timeout_and_the_janitors_durations_are_read_by_one_parser():
    """--prometheus-timeout takes what the janitor's --timeout takes (plain seconds as before)."""
    parser = build_parser()
    for text, seconds in (("5", 5.0), ("0.5", 0.5), ("500ms", 0.5), ("2m", 120.0)):
        assert parser.parse_args(["explain", "r1", f"--prometheus-timeout={text}"]).prometheus_timeout == seconds
        assert parser.parse_args(["janitor", f"--timeout={text}"]).timeout == seconds


def test_goodput_asks_for_the_run_named_even_when_it_holds_a_placeholder():
    with hostile.RawServer(hostile.empty_vector) as server:
        client = prometheus.Prometheus(resolve("prometheus", prometheus.ENV_URL, server.url))
        assert goodput.run_goodput(client, "SEL", "warm-RANGE-SEL", 1000.0, 1600.0) == {}
    queries = [parse_qs(urlsplit(head.split(b" ")[1].decode()).query)["query"][0] for head in server.requests]
    assert len(queries) == len(goodput.QUERIES)
    for query in queries:
        assert '{job="SEL",run="warm-RANGE-SEL"}[660s]' in query, query


def test_query_results_are_checked_series():
    """A vector whose samples are not [time, value] is the one-line error, not a crash further on."""
    answer = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                       "result": [{"metric": {"a": "b"}, "value": "x"}]}}).encode()
    with hostile.RawServer(lambda connection, _stop: connection.sendall(hostile.response(200, answer))) as server:
        client = prometheus.Prometheus(resolve("prometheus", prometheus.ENV_URL, server.url))
        with pytest.raises(prometheus.QueryError, match="malformed series"):
            client.query("up")


def test_the_hostile_servers_stop():
    """The helpers themselves: leaving the server ends a trickle that nobody reads any more."""
    with hostile.RawServer(hostile.trickle) as server:
        client = prometheus.Prometheus(resolve("prometheus", prometheus.ENV_URL, server.url), timeout=0.5)
        with pytest.raises(prometheus.QueryError, match="within 0.5 s"):
            client.query("up")
    assert server.stop.is_set() and len(server.requests) == 1


def test_a_socket_timeout_before_the_deadline_reads_as_the_deadline():
    """The socket timeout equals the deadline, so on a busy machine either may fire first: a silent
    server gets the same line both ways. Here the socket's timeout is made to fire first."""
    with hostile.RawServer(hostile.silent) as server:
        client = prometheus.Prometheus(resolve("prometheus", prometheus.ENV_URL, server.url), timeout=2)
        opened = client._open
        client._open = lambda request, _timeout: opened(request, 0.2)
        with pytest.raises(prometheus.QueryError, match=r"^query failed \(query\): no complete answer within 2 s$"):
            client.query("up")
