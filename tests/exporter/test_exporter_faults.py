"""Exporter faults with the real daemon and real HTTP scrapes: a GPU lost mid-run and back,
an NVML call hanging 30 s, NVML errors on one field. Scrapes keep answering fast with the other GPUs'
data; the hang shows in the snapshot age and error counters; the sampler recovers."""
from __future__ import annotations

import json
import time

import pynvml
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from stack import processes
from tests.support.exporter import faulty_exporter

pytestmark = pytest.mark.fault


class Scraper:
    """Scrapes the daemon and keeps every scrape's latency."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []

    def __call__(self) -> dict[str, list[tuple[dict, float]]]:
        started = time.perf_counter()
        response = requests.get(self.url + "/metrics", timeout=20)
        self.latencies.append(time.perf_counter() - started)
        assert response.status_code == 200
        out: dict[str, list[tuple[dict, float]]] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
        return out

    def assert_none_waited_on_nvml(self) -> None:
        """No scrape waited on the faulty GPU: one that called NVML would take the 30 s of the hang
        (a behaviour bound, not a speed figure: scrape latency is measured by bench/bench_exporter.py)."""
        assert max(self.latencies) < 10, sorted(self.latencies)[-5:]


def gpus(metrics: dict, name: str) -> set[str]:
    return {labels["gpu"] for labels, _ in metrics.get(name, [])}


def value(metrics: dict, name: str, **want: str) -> float | None:
    found = [v for labels, v in metrics.get(name, []) if want.items() <= labels.items()]
    return found[0] if found else None


def start(tmp_path, start_service, gpus_: int, plan: dict) -> Scraper:
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps(plan))
    exporter = start_service(faulty_exporter(tmp_path, ["--simulate=healthy", f"--simulate.gpus={gpus_}",
                                                        f"--faults={faults}", "--sample-interval=0.2"]))
    return Scraper(exporter.url)


def test_gpu_lost_mid_run_and_back(tmp_path, start_service):
    scrape = start(tmp_path, start_service, 3, {"faults": [
        {"gpu": 1, "function": "*", "error": "GpuIsLost", "at": 3, "until": 7},
        {"gpu": 2, "xid": 79, "at": 1, "times": 2}]})
    metrics = processes.wait_until(lambda: (m := scrape()) and value(m, "nvml_gpu_lost", gpu="1") == 1 and m,
                                   timeout=10, interval=0.1, what="GPU 1 reported lost")
    assert gpus(metrics, "nvml_gpu_memory_used_bytes") == {"0", "2"}
    assert gpus(metrics, "nvml_gpu_info") == {"0", "2"}
    assert value(metrics, "nvml_exporter_gpu_lost_total", gpu="1") == 1
    assert value(metrics, "nvml_up") == 1
    metrics = processes.wait_until(lambda: (m := scrape()) and value(m, "nvml_gpu_lost", gpu="1") == 0 and m,
                                   timeout=10, interval=0.1, what="GPU 1 back")
    assert gpus(metrics, "nvml_gpu_memory_used_bytes") == {"0", "1", "2"}
    assert value(metrics, "nvml_exporter_gpu_lost_total", gpu="1") == 1
    assert value(metrics, "nvml_gpu_xid_errors_total", gpu="2", xid="79") == 2
    scrape.assert_none_waited_on_nvml()


def test_hanging_call_and_failing_field(tmp_path, start_service):
    hang = 30
    scrape = start(tmp_path, start_service, 3, {"faults": [
        {"gpu": 0, "function": "nvmlDeviceGetTemperatureV", "hang": hang, "at": 2, "times": 1},
        {"gpu": 2, "field": pynvml.NVML_FI_DEV_POWER_INSTANT, "error": "Unknown"}]})
    # While GPU 0 hangs: the hang is reported, its stale series go, the others stay fresh.
    metrics = processes.wait_until(
        lambda: (m := scrape()) and value(m, "nvml_exporter_errors_total", collector="thermal", error="timeout") and m,
        timeout=15, interval=0.1, what="timeout counted while the call hangs")
    hang_seen = time.monotonic()
    assert value(metrics, "nvml_exporter_snapshot_age_seconds") > 1.0
    assert value(metrics, "nvml_exporter_gpu_sample_age_seconds", gpu="1") < 1.0
    assert gpus(metrics, "nvml_gpu_memory_used_bytes") == {"1", "2"}
    assert value(metrics, "nvml_gpu_lost", gpu="0") == 0  # slow is not lost
    # The failing field: counted, only that reading missing.
    assert gpus(metrics, "nvml_gpu_power_instant_watts") == {"1"}
    assert "2" in gpus(metrics, "nvml_gpu_energy_joules_total")
    assert value(metrics, "nvml_exporter_errors_total", collector="power", error="unknown") > 0
    assert value(metrics, "nvml_exporter_collector_success", collector="power") == 0
    ages = []
    while time.monotonic() - hang_seen < hang - 5:  # scrape all through the hang
        ages.append(value(scrape(), "nvml_exporter_snapshot_age_seconds"))
        time.sleep(0.2)
    assert ages == sorted(ages) and ages[-1] > 20  # the age keeps growing: the hang stays visible
    # The call returns; the sampler recovers on its own.
    metrics = processes.wait_until(
        lambda: (m := scrape()) and value(m, "nvml_exporter_snapshot_age_seconds") < 1.0 and m,
        timeout=15, interval=0.1, what="sampler recovered after the hang")
    assert gpus(metrics, "nvml_gpu_memory_used_bytes") == {"0", "1", "2"}
    assert value(metrics, "nvml_exporter_errors_total", collector="thermal", error="timeout") == 1
    scrape.assert_none_waited_on_nvml()
