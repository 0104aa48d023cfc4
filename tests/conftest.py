"""Shared fixtures: real daemons on loopback ports, stopped after each test."""
from __future__ import annotations

from typing import Callable, Iterator

import pytest

from stack.processes import Service, WebhookReceiver
from tests.certs import Pki, make_pki


@pytest.fixture
def start_service() -> Iterator[Callable[[Service], Service]]:
    """Start a `stack.processes` Service and stop it (and every other one started) at teardown."""
    started: list[Service] = []

    def start(service: Service) -> Service:
        started.append(service)
        return service.start()

    yield start
    for service in reversed(started):
        service.stop()


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    """A loopback webhook recording Alertmanager's notifications, stopped at teardown."""
    receiver = WebhookReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    """Throw-away test CA, server and client certificates (tests/certs.py), made once per session."""
    return make_pki(tmp_path_factory.mktemp("pki"))
