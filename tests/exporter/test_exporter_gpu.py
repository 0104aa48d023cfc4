"""The exporter on real NVML, checked against nvidia-smi (runs only where a GPU is present)."""
from __future__ import annotations

import csv
import subprocess

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from stack import processes
from tests.support.daemons import promtool_check

pytestmark = pytest.mark.gpu
FIELDS = ("index", "uuid", "name", "memory.total", "temperature.gpu", "power.limit", "clocks.max.sm")


def nvidia_smi() -> list[dict[str, str]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return [dict(zip(FIELDS, (cell.strip() for cell in row))) for row in csv.reader(out.splitlines())]


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def test_real_gpus_match_nvidia_smi(tmp_path, start_service):
    exporter = start_service(processes.exporter(tmp_path, ["--sample-interval=0.5"]))
    gpus = nvidia_smi()

    def scrape() -> dict | None:
        text = requests.get(exporter.url + "/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((s.labels, s.value))
        return (text, samples) if len(samples.get("nvml_gpu_info", [])) == len(gpus) else None
    text, samples = processes.wait_until(scrape, timeout=30, what="every GPU sampled")
    promtool_check(text)
    assert samples["nvml_up"][0][1] == 1

    def value(name: str, uuid: str, **labels: str) -> float | None:
        found = [v for have, v in samples.get(name, []) if have["uuid"] == uuid and labels.items() <= have.items()]
        return found[0] if found else None

    for gpu in gpus:
        uuid = gpu["uuid"]
        [info] = [labels for labels, _ in samples["nvml_gpu_info"] if labels["uuid"] == uuid]
        assert (info["gpu"], info["name"], info["simulated"]) == (gpu["index"], gpu["name"], "false")
        assert value("nvml_gpu_memory_total_bytes", uuid) == pytest.approx(float(gpu["memory.total"]) * 2**20,
                                                                        rel=0.01)
        if number(gpu["temperature.gpu"]) is not None:
            assert value("nvml_gpu_temperature_celsius", uuid) == pytest.approx(float(gpu["temperature.gpu"]), abs=5)
        if number(gpu["power.limit"]) is not None:
            assert value("nvml_gpu_power_limit_watts", uuid) == pytest.approx(float(gpu["power.limit"]), abs=1)
        if number(gpu["clocks.max.sm"]) is not None:
            assert value("nvml_gpu_clock_max_hertz", uuid, clock="sm") == float(gpu["clocks.max.sm"]) * 1e6
        assert value("nvml_gpu_lost", uuid) == 0
