"""Pull mode's endpoint (listen_port) bounded like the exporter's: a fixed number of threads however
many clients connect, a deadline on each request head, TLS and basic auth with a real client, and no
password served over plain http beyond loopback."""
from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import requests
import yaml

from stack import processes
from tests.support.hook import run_id
from trainer_hook import TrainingMonitor, serve

USER, PASSWORD = "prometheus", "pull-Sekret-9"


def puller(tmp_path, **kwargs) -> TrainingMonitor:
    options = {"job": "pull", "run": run_id("pull"), "pushgateway": False, "record_path": False,
               "listen_port": 0, "push_interval": 0.05, **kwargs}
    monitor = TrainingMonitor(**options)
    monitor.log({"loss": 0.25}, step=1)
    return monitor


def scrape(url: str, **kwargs) -> requests.Response:
    return requests.get(url, timeout=10, **kwargs)


def served_loss(response: requests.Response) -> bool:
    return response.status_code == 200 and "training_loss{" in response.text


def closed(sock: socket.socket) -> bool:
    """The server closed `sock` (an end of stream, or a reset: it had unread bytes)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def closed_yet(sock: socket.socket) -> bool:
    """`closed`, without waiting: False while the server keeps `sock` open with nothing to say."""
    sock.setblocking(False)
    try:
        return closed(sock)
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)


def test_300_half_sent_requests_cost_no_thread_and_a_good_scrape_still_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "HEAD_DEADLINE", 5.0)
    monitor = puller(tmp_path)
    url = f"http://127.0.0.1:{monitor.listen_port}/metrics"
    processes.wait_until(lambda: served_loss(scrape(url)), 10, what="the first scrape")
    before = threading.active_count()
    hostile = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", monitor.listen_port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the head's end never comes
            hostile.append(sock)
        time.sleep(0.5)  # let the server take them all (a thread per connection would exist now)
        assert threading.active_count() <= before + 2
        assert served_loss(scrape(url))
        assert not closed_yet(hostile[-1])  # answered while the newest half-sent request still waits
        # each half-sent request is closed by its deadline (or made room for a newer one)
        for sock in hostile:
            sock.settimeout(serve.HEAD_DEADLINE + 5)
            assert closed(sock)
    finally:
        for sock in hostile:
            sock.close()
        monitor.close()
    assert threading.active_count() <= before - 1 - serve.WORKERS + 2


def test_tls_and_basic_auth_with_a_real_client(tmp_path, pki):
    monitor = puller(tmp_path, listen_basic_auth=(USER, PASSWORD), listen_tls=(str(pki.server_cert),
                                                                               str(pki.server_key)))
    url = f"https://127.0.0.1:{monitor.listen_port}/metrics"
    try:
        processes.wait_until(lambda: served_loss(scrape(url, auth=(USER, PASSWORD), verify=str(pki.ca_cert))),
                             10, what="a scrape over TLS with the password")
        assert scrape(url, auth=(USER, "wrong"), verify=str(pki.ca_cert)).status_code == 401
        unauthorized = scrape(url, verify=str(pki.ca_cert))
        assert unauthorized.status_code == 401 and "training_loss" not in unauthorized.text
        with pytest.raises(requests.exceptions.SSLError):
            scrape(url, auth=(USER, PASSWORD), verify=str(pki.other_ca_cert))
        with pytest.raises(requests.exceptions.ConnectionError):
            scrape(url.replace("https", "http"), auth=(USER, PASSWORD))  # no plain http on the TLS port
        assert served_loss(scrape(url, auth=(USER, PASSWORD), verify=str(pki.ca_cert)))  # still serving
    finally:
        monitor.close()


@pytest.mark.e2e
def test_a_real_prometheus_scrapes_it_over_tls_with_basic_auth(tmp_path, pki, start_service):
    monitor = puller(tmp_path, listen_basic_auth=(USER, PASSWORD), listen_tls=(str(pki.server_cert),
                                                                               str(pki.server_key)))
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "pull", "scheme": "https", "tls_config": {"ca_file": str(pki.ca_cert)},
         "basic_auth": {"username": USER, "password": PASSWORD},
         "static_configs": [{"targets": [f"127.0.0.1:{monitor.listen_port}"]}]}]}))
    prometheus = start_service(processes.prometheus(tmp_path, config))

    def loss() -> list:
        answer = requests.get(prometheus.url + "/api/v1/query", params={"query": 'training_loss{job="pull"}'},
                              timeout=10).json()
        return [sample["value"][1] for sample in answer["data"]["result"]]
    try:
        assert processes.wait_until(loss, 30, what="Prometheus scraping the hook over TLS") == ["0.25"]
    finally:
        monitor.close()


def test_credentials_from_the_environment(tmp_path, pki, monkeypatch):
    monkeypatch.setenv("DUALTRACK_LISTEN_USERNAME", USER)
    monkeypatch.setenv("DUALTRACK_LISTEN_PASSWORD", PASSWORD)
    monkeypatch.setenv("DUALTRACK_LISTEN_CERT_FILE", str(pki.server_cert))
    monkeypatch.setenv("DUALTRACK_LISTEN_KEY_FILE", str(pki.server_key))
    monitor = puller(tmp_path)
    url = f"https://127.0.0.1:{monitor.listen_port}/metrics"
    try:
        assert PASSWORD not in repr(monitor.settings)
        processes.wait_until(lambda: served_loss(scrape(url, auth=(USER, PASSWORD), verify=str(pki.ca_cert))),
                             10, what="a scrape with the environment's password")
        assert scrape(url, verify=str(pki.ca_cert)).status_code == 401
    finally:
        monitor.close()


def test_a_password_over_plain_http_beyond_loopback_is_refused(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainer_hook")
    monitor = puller(tmp_path, listen_address="0.0.0.0", listen_basic_auth=(USER, PASSWORD))
    try:
        assert monitor.listen_port is None and monitor.settings.refused_sinks == ("pull-mode endpoint",)
    finally:
        monitor.close()
    assert "plain http://" in caplog.text and PASSWORD not in caplog.text
    with pytest.raises(ValueError, match="plain http://"):
        puller(tmp_path, listen_address="0.0.0.0", listen_basic_auth=(USER, PASSWORD), strict=True)
    lab = puller(tmp_path, listen_address="0.0.0.0", listen_basic_auth=(USER, PASSWORD),
                 allow_insecure_credentials=True)
    try:
        processes.wait_until(lambda: served_loss(scrape(f"http://127.0.0.1:{lab.listen_port}/metrics",
                                                        auth=(USER, PASSWORD))), 10, what="the lab's scrape")
    finally:
        lab.close()


def test_unknown_paths_and_methods_are_refused(tmp_path):
    monitor = puller(tmp_path)
    base = f"http://127.0.0.1:{monitor.listen_port}"
    try:
        assert scrape(base + "/favicon.ico").status_code == 404
        assert requests.post(base + "/metrics", data=b"x", timeout=10).status_code == 405
        processes.wait_until(lambda: served_loss(scrape(base + "/metrics?debug=1")), 10, what="a scrape")
    finally:
        monitor.close()


def test_the_kubernetes_pod_monitor_scrapes_over_https_with_basic_auth():
    """The pod-monitor component never asks for 0.0.0.0 without TLS and a password: its PodMonitor
    scrapes with https, a CA and a user from Secrets, and its comment names the hook's variables."""
    from tests.support.deploy import KUBE, find, with_components
    endpoint, = find("PodMonitor", "dualtrack-training", with_components("pod-monitor"))["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["ca"]["secret"]["name"] == "dualtrack-pull-tls"
    assert {endpoint["basicAuth"][key]["name"] for key in ("username", "password")} == {"dualtrack-pull-auth"}
    text = (KUBE / "components" / "pod-monitor" / "kustomization.yaml").read_text()
    for variable in ("DUALTRACK_LISTEN_ADDRESS=0.0.0.0", "DUALTRACK_LISTEN_CERT_FILE", "DUALTRACK_LISTEN_USERNAME"):
        assert variable in text, variable
