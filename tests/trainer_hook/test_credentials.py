"""Credentials for the Pushgateway and Prometheus, and the Prometheus client: one rule for URLs, TLS and
auth, and no secret ever in a log line, an error, a report or repr() (each test greps the real output
for the password); a malformed Prometheus answer is one warning, never a traceback."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from dualtrack.cli import main
from stack import processes
from tests.support.certs import PASSWORD as PGW_PASSWORD
from tests.support.certs import USER, bcrypt_hash
from tests.support.hook import http_gateway, run_id, wait_pushed
from tests.support.records import synthetic_record
from tests.support.remote_write import receiver
from trainer_hook import TrainingMonitor
from trainer_hook.connection import resolve

PASSWORD = "hunter2-Sekret"
TOKEN = "tok-Sekret-42"


def one_line_without_secrets(text: str) -> None:
    assert text.count("\n") <= 1 and "Traceback" not in text, text
    assert PASSWORD not in text and TOKEN not in text, text


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def dualtrack(capsys, monkeypatch) -> Callable[..., Result]:
    """Run `dualtrack ARGS...` in this process (with `env` set), capturing its exit code and output."""
    def run(*args: str, env: dict[str, str] | None = None) -> Result:
        with monkeypatch.context() as patch:
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            capsys.readouterr()
            code = main(list(args))
        return Result(code, *capsys.readouterr())
    return run


def test_credentials_in_a_url_are_refused_with_one_line_that_does_not_repeat_them(tmp_path, caplog, monkeypatch,
                                                                                   dualtrack):
    url = f"http://hook:{PASSWORD}@127.0.0.1:{processes.free_port()}"
    with pytest.raises(ValueError) as raised:
        TrainingMonitor(job="cred", run=run_id("url"), pushgateway=url, record_path=False)
    one_line_without_secrets(str(raised.value))
    assert "must not contain credentials" in str(raised.value)
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY", url)
    with pytest.raises(ValueError) as raised:
        TrainingMonitor(job="cred", run=run_id("env"), record_path=False)
    one_line_without_secrets(str(raised.value))
    assert PASSWORD not in caplog.text

    janitor = dualtrack("janitor", "--once", f"--pushgateway={url}")
    assert janitor.returncode == 2 and "must not contain credentials" in janitor.stderr
    one_line_without_secrets(janitor.stderr + janitor.stdout)

    record = synthetic_record(tmp_path / "a.jsonl", "a", 20)
    out = tmp_path / "r.html"
    report = dualtrack("report", str(record), "--out", str(out), "--prometheus", url.replace("9091", "9090"))
    assert report.returncode == 2 and "must not contain credentials" in report.stderr
    one_line_without_secrets(report.stderr + report.stdout)
    assert not out.exists()


def test_repr_of_settings_and_clients_shows_no_secret(monkeypatch):
    with http_gateway(lambda request: 200) as url:
        with TrainingMonitor(job="cred", run=run_id("repr"), pushgateway=url, basic_auth=("hook", PASSWORD),
                             record_path=False, push_interval=60) as monitor:
            text = repr(monitor.settings)
    assert "hook" not in text and PASSWORD not in text and url in text
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_TOKEN", TOKEN)
    assert TOKEN not in repr(resolve("pushgateway", "DUALTRACK_PUSHGATEWAY", url))  # the janitor's connection

    from argparse import Namespace

    from dualtrack import prometheus
    monkeypatch.setenv("DUALTRACK_PROMETHEUS_USERNAME", "grafana")
    monkeypatch.setenv("DUALTRACK_PROMETHEUS_PASSWORD", PASSWORD)
    client = prometheus.from_args(Namespace(prometheus="http://127.0.0.1:9090", prometheus_username=None,
                                            prometheus_password_file=None, prometheus_bearer_token_file=None,
                                            prometheus_ca_file=None), print)
    assert PASSWORD not in repr(client) and PASSWORD not in repr(client.endpoint)


def test_each_sink_gets_only_the_credentials_given_for_it(secure_pgw, pki, tmp_path):
    """A real Pushgateway behind TLS and basic auth, and a plain loopback remote-write receiver that
    records every request's headers: the Pushgateway's password never reaches the receiver, which gets
    its own token, or nothing."""
    with receiver() as (url, got):
        for own in ({}, {"remote_write_bearer_token": TOKEN}):
            run = run_id("sinks")
            with TrainingMonitor(job="cred", run=run, pushgateway=secure_pgw.url, basic_auth=(USER, PGW_PASSWORD),
                                 ca_file=str(pki.ca_cert), remote_write_url=url, push_interval=0.05,
                                 record_path=False, delete_after=None, **own) as monitor:
                monitor.log({"loss": 0.5}, step=1)
                processes.wait_until(lambda: len(got) >= 3, 30, what="remote writes")
            wait_pushed(secure_pgw.url, "training_loss", run, lambda v: v == 0.5,
                        http={"auth": (USER, PGW_PASSWORD), "verify": str(pki.ca_cert)})
            sent = [request.headers.get("Authorization") for request in got]
            assert set(sent) == ({"Bearer " + TOKEN} if own else {None}), sent
            got.clear()


def test_pushgateway_credentials_without_a_pushgateway_are_an_error_for_remote_write(tmp_path):
    with pytest.raises(ValueError, match="remote_write_basic_auth") as raised:
        TrainingMonitor(job="cred", run=run_id("rw"), remote_write_url="http://127.0.0.1:9/api/v1/write",
                        basic_auth=("hook", PASSWORD), record_path=False)
    one_line_without_secrets(str(raised.value))


def test_credentials_over_plain_http_to_another_host_are_refused_unless_opted_in(caplog, monkeypatch):
    """The hook leaves the sink out with one warning (counted; strict raises); a lab may opt in, then
    it is warned about once per URL."""
    host = "192.0.2.1"  # TEST-NET-1: never answers
    plain = {"job": "cred", "pushgateway": f"http://{host}:9091", "push_interval": 60, "push_timeout": 0.2,
             "basic_auth": ("hook", PASSWORD), "record_path": False, "delete_after": None}
    with TrainingMonitor(run=run_id("refused"), remote_write_url=f"http://{host}:9090/api/v1/write",
                         remote_write_bearer_token=TOKEN, **plain) as monitor:
        assert monitor._pusher is None and monitor._writer is None
        assert monitor.settings.refused_sinks == ("Pushgateway", "remote-write receiver")
        assert monitor._latest.push_failures == 2
    refusals = [r.getMessage() for r in caplog.records if "plain http://" in r.getMessage()]
    assert len(refusals) == 2 and all(host in line and "\n" not in line for line in refusals)
    assert PASSWORD not in caplog.text and TOKEN not in caplog.text

    with pytest.raises(ValueError, match="plain http://") as raised:
        TrainingMonitor(run=run_id("strict"), strict=True, **plain)
    one_line_without_secrets(str(raised.value))

    caplog.clear()
    for opt_in in ({"allow_insecure_credentials": True}, {}):
        if not opt_in:
            monkeypatch.setenv("DUALTRACK_ALLOW_INSECURE_CREDENTIALS", "1")
        with TrainingMonitor(run=run_id("lab"), **plain, **opt_in) as monitor:
            assert monitor._pusher is not None and not monitor.settings.refused_sinks
    warnings = [r.getMessage() for r in caplog.records if "plain http://" in r.getMessage()]
    assert len(warnings) == 1 and host in warnings[0] and PASSWORD not in caplog.text


def test_the_command_refuses_credentials_over_plain_http_to_another_host(tmp_path, caplog, dualtrack):
    token = {"DUALTRACK_PUSHGATEWAY_TOKEN": TOKEN}
    janitor = dualtrack("janitor", "--once", "--timeout=1s", "--pushgateway=http://192.0.2.2:9091", env=token)
    assert janitor.returncode == 2 and "plain http://" in janitor.stderr
    one_line_without_secrets(janitor.stderr + janitor.stdout)
    lab = {**token, "DUALTRACK_ALLOW_INSECURE_CREDENTIALS": "1"}
    assert dualtrack("janitor", "--once", "--timeout=1s", "--pushgateway=http://192.0.2.2:9091", env=lab
                     ).returncode == 1  # tried: unreachable
    assert caplog.text.count("plain http://") == 1 and TOKEN not in caplog.text

    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    record = synthetic_record(tmp_path / "a.jsonl", "a", 20)
    flags = ["--prometheus-username=grafana", f"--prometheus-password-file={password_file}"]
    remote = dualtrack("report", str(record), "--out", str(tmp_path / "r.html"),
                       "--prometheus=http://192.0.2.1:9090", *flags)
    assert remote.returncode == 2 and "plain http://" in remote.stderr and not (tmp_path / "r.html").exists()
    one_line_without_secrets(remote.stderr)
    local = dualtrack("report", str(record), "--out", str(tmp_path / "l.html"),
                      f"--prometheus=http://127.0.0.1:{processes.free_port()}", *flags)
    assert local.returncode == 0 and "plain http://" not in local.stderr


def test_a_ca_file_with_a_plain_http_url_is_a_one_line_error(tmp_path, pki, dualtrack):
    with pytest.raises(ValueError, match="needs https://"):
        TrainingMonitor(job="cred", run=run_id("ca"), pushgateway="http://127.0.0.1:9091", ca_file=str(pki.ca_cert),
                        record_path=False)
    janitor = dualtrack("janitor", "--once", "--pushgateway=http://127.0.0.1:9091",
                        env={"DUALTRACK_PUSHGATEWAY_CA_FILE": str(pki.ca_cert)})
    assert janitor.returncode == 2 and "needs https://" in janitor.stderr
    one_line_without_secrets(janitor.stderr)
    report = dualtrack("report", str(synthetic_record(tmp_path / "a.jsonl", "a", 20)),
                       "--out", str(tmp_path / "r.html"),
                       "--prometheus=http://127.0.0.1:9090", f"--prometheus-ca-file={pki.ca_cert}")
    assert report.returncode == 2 and "needs https://" in report.stderr
    one_line_without_secrets(report.stderr)


@contextmanager
def redirect_to_another_host() -> Iterator[tuple[str, list[str | None]]]:
    """A server on 127.0.0.1 answering every request with a 307 to a server on 127.0.0.2 (another host),
    which records the Authorization header of each request it gets; yields (first URL, recorded)."""
    seen: list[str | None] = []

    class Other(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = b'{"status": "success", "data": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_GET = do_PUT = do_DELETE = _answer

        def log_message(self, *args) -> None:
            pass

    other = ThreadingHTTPServer(("127.0.0.2", 0), Other)

    class Redirect(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.2:{other.server_port}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()
        do_GET = do_PUT = do_DELETE = _answer

        def log_message(self, *args) -> None:
            pass

    first = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    for server in (other, first):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{first.server_port}", seen
    finally:
        for server in (first, other):
            server.shutdown()
            server.server_close()


def test_no_client_follows_a_redirect_so_credentials_never_reach_another_host(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_USERNAME", "hook")
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_PASSWORD", PASSWORD)
    with redirect_to_another_host() as (url, seen):
        assert main(["janitor", "--once", f"--pushgateway={url}"]) == 1
        with TrainingMonitor(job="cred", run=run_id("redirect"), pushgateway=url, basic_auth=("hook", PASSWORD),
                             push_interval=60, record_path=False) as monitor:
            monitor.log({"loss": 1.0}, step=0)
        assert monitor._pusher.failures >= 1
        password_file = tmp_path / "password"
        password_file.write_text(PASSWORD)
        out = tmp_path / "r.html"
        assert main(["report", str(synthetic_record(tmp_path / "a.jsonl", "a", 20)), "--out", str(out),
                     f"--prometheus={url}", "--prometheus-username=grafana",
                     f"--prometheus-password-file={password_file}"]) == 0
        assert seen == []  # nothing reached the other host, with or without credentials
    assert "redirect not followed" in out.read_text() and PASSWORD not in out.read_text()
    assert "redirect not followed" in caplog.text and PASSWORD not in caplog.text


@pytest.fixture
def secure_prometheus(tmp_path, pki, start_service) -> processes.Service:
    """A real Prometheus behind TLS (the test CA) and basic auth (user grafana)."""
    web = tmp_path / "prometheus-web.yml"
    web.write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
        "basic_auth_users": {"grafana": bcrypt_hash(PASSWORD)}}))
    config = processes.render_prometheus_config(tmp_path, {})
    return start_service(processes.prometheus(tmp_path, config, web_config=web, auth=("grafana", PASSWORD)))


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["flags", "environment"])
def test_report_reads_prometheus_over_tls_with_basic_auth_and_writes_no_secret(tmp_path, pki, secure_prometheus,
                                                                               how, dualtrack):
    record = synthetic_record(tmp_path / "a.jsonl", "a", 20)
    password_file = tmp_path / "password"

    def report(password: str) -> tuple[Result, str]:
        password_file.write_text(password + "\n")
        out = tmp_path / "r.html"
        if how == "flags":
            result = dualtrack("report", str(record), "--out", str(out), f"--prometheus={secure_prometheus.url}",
                               "--prometheus-username=grafana", f"--prometheus-password-file={password_file}",
                               f"--prometheus-ca-file={pki.ca_cert}")
        else:
            result = dualtrack("report", str(record), "--out", str(out), env={
                "DUALTRACK_PROMETHEUS": secure_prometheus.url, "DUALTRACK_PROMETHEUS_USERNAME": "grafana",
                "DUALTRACK_PROMETHEUS_PASSWORD": password, "DUALTRACK_PROMETHEUS_CA_FILE": str(pki.ca_cert)})
        assert result.returncode == 0, result.stderr
        page = out.read_text()
        assert password not in page + result.stderr + result.stdout
        return result, page

    result, page = report(PASSWORD)
    assert result.stderr == "" and f"Prometheus: {secure_prometheus.url}</p>" in page  # read, nothing failed
    result, page = report("not-the-" + PASSWORD)
    assert "HTTP 401" in result.stderr and "query failed" in page


@pytest.mark.e2e
def test_the_prometheus_client_queries_and_lists_alerts_over_tls_with_basic_auth(tmp_path, pki, secure_prometheus):
    from argparse import Namespace

    from dualtrack import prometheus
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    args = Namespace(prometheus=secure_prometheus.url, prometheus_username="grafana",
                     prometheus_password_file=password_file, prometheus_bearer_token_file=None,
                     prometheus_ca_file=str(pki.ca_cert))
    client = prometheus.from_args(args, pytest.fail)
    assert client.query("vector(42)")[0]["value"][1] == "42"
    assert client.query_range("vector(1)", 1000, 1010, 5)[0]["values"][0] == (1000.0, 1.0)
    assert client.alerts() == []
    anonymous = prometheus.from_args(Namespace(**{**vars(args), "prometheus_username": None,
                                                  "prometheus_password_file": None}), pytest.fail)
    with pytest.raises(prometheus.QueryError, match="HTTP 401"):
        anonymous.query("vector(1)")


@pytest.mark.e2e
def test_an_uppercase_https_scheme_still_uses_the_ca_file(secure_pgw, pki, tmp_path):
    url = secure_pgw.url.replace("https://", "HTTPS://")
    with TrainingMonitor(job="cred", run=run_id("upper"), pushgateway=url, basic_auth=(USER, PGW_PASSWORD),
                         ca_file=str(pki.ca_cert), push_interval=60, record_path=False) as monitor:
        monitor.log({"loss": 1.0}, step=0)
    assert monitor._pusher.failures == 0


@pytest.mark.parametrize("body", [
    b'{"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {}, "values": [["x", "y"]]}]}}',
    b'{"status": "success", "data": {"resultType": "matrix", "result": [{"metric": 7, "values": []}]}}',
    b'{"status": "success", "data": {"result": "none"}}',
], ids=["not-numbers", "not-labels", "not-a-list"])
def test_a_malformed_prometheus_answer_is_one_warning_and_the_record_report(tmp_path, dualtrack, body):
    with http_gateway(lambda request: 200, body) as url:
        result = dualtrack("report", str(synthetic_record(tmp_path / "a.jsonl", "a", 20)),
                           "--out", str(tmp_path / "r.html"), f"--prometheus={url}")
    assert result.returncode == 0 and result.stderr.count("\n") == 1 and "query failed" in result.stderr
    assert "query failed" in (tmp_path / "r.html").read_text()
