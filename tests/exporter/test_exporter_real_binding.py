"""The exporter through the real nvidia-ml-py on a fake libnvidia-ml.so.1 (tests/support/fake_nvml.c): the binding's
own loading, marshalling and error mapping run, as they do on a node."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stack import processes
from tests.support import fake_libnvml
from tests.support.exporter import scraped
from tests.support.paths import REPO

PROBE = """
import json, pynvml
from exporter.nvml import Nvml
nvml = Nvml(pynvml)
nvml.init()
[device] = nvml.devices()
values = device.field_values([(197, 0), (198, 0), (83, 0), (138, 0xFFFFFFFF)])
try:
    pynvml.nvmlDeviceGetProcessUtilization(device.handle, 0)
    empty = "answered"
except pynvml.NVMLError as exc:
    empty = exc.value
try:
    pynvml.nvmlDeviceGetClockInfo(device.handle, 0)
    missing = "answered"
except pynvml.NVMLError_FunctionNotFound:
    missing = "function_not_found"
print(json.dumps({"name": device.name, "uuid": device.uuid, "library": pynvml.nvmlLib._name, "empty": empty,
                  "missing": missing, "bits": {str(f): v.bits for (f, _), v in values.items()},
                  "absent": sorted(key[1][0] for key in device.absent if key[0] == "field")}))
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> dict[str, str]:
    """The environment that makes nvidia-ml-py load the fake library: LD_LIBRARY_PATH, read at process start."""
    directory = fake_libnvml.build(tmp_path_factory.mktemp("fake-driver"))
    return {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("LD_LIBRARY_PATH")]))}


def test_the_binding_reads_field_widths_and_returns_as_the_driver_answers_them(fake_driver):
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **fake_driver})
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["library"] == fake_libnvml.LIBRARY and seen["name"] == "NVIDIA H100 80GB HBM3"
    assert seen["bits"] == {"197": 32, "198": 32, "83": 64}  # the PCIe counters' value type is unsigned int
    assert seen["absent"] == [138]
    assert seen["empty"] == 0  # SUCCESS without samples: pynvml raises NVMLError(0)
    assert seen["missing"] == "function_not_found"


def test_the_daemon_on_the_real_binding_gives_true_pcie_rates_mean_power_and_no_errors(fake_driver, tmp_path,
                                                                                      start_service):
    exporter = start_service(processes.exporter(tmp_path, ["--sample-interval=0.5", "--no-collector.xid"],
                                                env=fake_driver))

    def value(metric: str, **labels: str) -> float | None:
        samples = scraped(exporter.url).get(metric, [])
        return next((s.value for s in samples if labels.items() <= s.labels.items()), None)

    processes.wait_until(lambda: value("nvml_gpu_pcie_throughput_bytes_per_second", direction="tx") is not None
                         and value("nvml_gpu_process_sm_utilization_ratio") is not None,
                         timeout=20, what="PCIe rates and process utilization")
    for _ in range(2):  # two more samples (NVML calls made twice since): the power mean has two energy readings
        calls = value("nvml_exporter_nvml_calls_total")
        processes.wait_until(lambda calls=calls: value("nvml_exporter_nvml_calls_total") > calls, timeout=10,
                             what="a sample")
    # 6 GB/s through a 32-bit counter read every 0.5 s would alias; the exporter does not take that rate
    assert value("nvml_gpu_pcie_throughput_bytes_per_second", direction="tx") == pytest.approx(fake_libnvml.PCIE_TX,
                                                                                             rel=1e-3)
    assert value("nvml_gpu_pcie_throughput_bytes_per_second", direction="rx") == pytest.approx(fake_libnvml.PCIE_RX,
                                                                                             rel=1e-3)
    assert value("nvml_gpu_power_usage_watts") == pytest.approx(fake_libnvml.WATTS, rel=0.05)
    assert value("nvml_gpu_power_instant_watts") == fake_libnvml.INSTANT_WATTS
    assert value("nvml_gpu_process_sm_utilization_ratio") == 0
    assert value("nvml_gpu_memory_total_bytes") == 80 * 2**30  # through the v1 call: the driver lacks _v2
    assert value("nvml_gpu_info", name="NVIDIA H100 80GB HBM3") == 1
    assert scraped(exporter.url).get("nvml_exporter_errors_total", []) == []
