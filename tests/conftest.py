"""Shared fixtures: real daemons on loopback ports, stopped after each test."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from stack import processes
from stack.processes import Service, WebhookReceiver
from tests.support.certs import PASSWORD, USER, Pki, bcrypt_hash, make_pki

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
    """Throw-away test CA, server and client certificates (tests/support/certs.py), made once per session."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secure_pgw(tmp_path: Path, pki: Pki, start_service: Callable[[Service], Service]) -> Service:
    """A real Pushgateway behind TLS (our test CA) and basic auth (bcrypt hash) via --web.config.file."""
    config = tmp_path / "web.yml"
    config.write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
        "basic_auth_users": {USER: bcrypt_hash(PASSWORD)}}))
    service = processes.pushgateway(tmp_path)
    service.argv.append(f"--web.config.file={config}")
    service.scheme, service.auth = "https", (USER, PASSWORD)
    return start_service(service)


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
