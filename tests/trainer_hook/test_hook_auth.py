"""Pushing to a secured Pushgateway: TLS with our CA, basic auth (real daemon), bearer token."""
from __future__ import annotations

import logging

import pytest

from tests.support.certs import PASSWORD, USER
from tests.support.hook import http_gateway, run_id, wait_pushed
from trainer_hook import TrainingMonitor
from trainer_hook.contract import Snapshot
from trainer_hook.push import Pusher, make_handler

pytestmark = pytest.mark.e2e


def _push_once(tmp_path, url: str, **kwargs) -> TrainingMonitor:
    run = run_id("auth")
    with TrainingMonitor(job="auth", run=run, pushgateway=url, push_interval=60, push_timeout=2,
                         record_path=tmp_path / f"{run}.jsonl", **kwargs) as monitor:
        monitor.log({"loss": 0.5}, step=1)
    return monitor


def test_tls_and_basic_auth_to_a_real_pushgateway(secure_pgw, tmp_path, pki):
    monitor = _push_once(tmp_path, secure_pgw.url, basic_auth=(USER, PASSWORD), ca_file=str(pki.ca_cert))
    assert monitor._pusher.failures == 0
    wait_pushed(secure_pgw.url, "training_loss", monitor.settings.run, lambda v: v == 0.5,
                http={"auth": (USER, PASSWORD), "verify": str(pki.ca_cert)})


def test_credentials_and_ca_from_the_environment(secure_pgw, tmp_path, pki, monkeypatch):
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_USERNAME", USER)
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_PASSWORD", PASSWORD)
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY_CA_FILE", str(pki.ca_cert))
    assert _push_once(tmp_path, secure_pgw.url)._pusher.failures == 0


@pytest.mark.parametrize("password, ca", [
    ("wrong", "ca_cert"),  # refused: 401
    (PASSWORD, "other_ca_cert"),  # the server certificate is not signed by that CA
    (PASSWORD, None),  # the system CAs do not know our test CA
], ids=["wrong-password", "other-ca", "system-ca"])
def test_refused_pushes_are_counted_and_warned_not_raised(secure_pgw, tmp_path, pki, caplog, password, ca):
    caplog.set_level(logging.WARNING, logger="trainer_hook")
    monitor = _push_once(tmp_path, secure_pgw.url, basic_auth=(USER, password),
                         ca_file=str(getattr(pki, ca)) if ca else None)
    assert monitor._pusher.failures >= 1
    assert "training continues" in caplog.text


def test_insecure_tls_verify_off_still_authenticates_and_is_warned_about_once(secure_pgw, tmp_path, caplog):
    for _ in range(2):
        monitor = _push_once(tmp_path, secure_pgw.url, basic_auth=(USER, PASSWORD), tls_verify=False)
        assert monitor._pusher.failures == 0
    warnings = [r.getMessage() for r in caplog.records if "verification is off" in r.getMessage()]
    assert len(warnings) == 1 and secure_pgw.url in warnings[0] and PASSWORD not in caplog.text


def test_bearer_token_is_sent_as_authorization_header(tmp_path):
    seen: list[str | None] = []

    def respond(request) -> int:
        seen.append(request.headers.get("Authorization"))
        return 200

    with http_gateway(respond) as url:
        monitor = _push_once(tmp_path, url, bearer_token="tok-123")
    assert monitor._pusher.failures == 0 and seen and set(seen) == {"Bearer tok-123"}


def test_pushes_reuse_one_connection_and_each_carries_the_credentials():
    """A run's pushes share one TCP connection (a handshake per push is load on the Pushgateway at
    thousands of ranks), and every push on it still sends the Authorization header."""
    seen: list[tuple[int, str | None]] = []

    def respond(request) -> int:
        seen.append((request.client_address[1], request.headers.get("Authorization")))
        return 200

    with http_gateway(respond, keep_alive=True) as url:
        with TrainingMonitor(job="auth", run=run_id("keepalive"), pushgateway=url, bearer_token="tok-7",
                             push_interval=60, record_path=False, delete_after=None) as monitor:
            settings = monitor.settings
        seen.clear()  # the monitor's own pushes, on its own connection
        pusher = Pusher(settings, make_handler(settings))
        try:
            assert all(pusher.push(Snapshot()) for _ in range(3))
        finally:
            pusher.stop(1.0)
    assert len(seen) == 3 and {auth for _, auth in seen} == {"Bearer tok-7"}
    assert len({port for port, _ in seen}) == 1, seen  # one client port: one connection
