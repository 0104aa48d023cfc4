"""Shared fixtures: real daemons on loopback ports, stopped after each test."""
from __future__ import annotations

import os
from typing import Callable, Iterator

import pytest

from stack.processes import Service, WebhookReceiver
from tests.certs import Pki, make_pki

# Monitors that tests close keep their final state on the test Pushgateway instead of making the
# session wait at exit to delete it (tests of the deletion pass delete_after explicitly).
os.environ.setdefault("DUALTRACK_DELETE_AFTER", "none")


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests run only where an NVIDIA driver answers (nvidia-smi -L lists a GPU)."""
    if _gpu_present():
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _gpu_present() -> bool:
    import shutil
    import subprocess
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout
