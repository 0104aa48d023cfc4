"""What only hardware settles about the counters (runs only where a GPU is present): the width and return
of each field the exporter reads, the PCIe rate against `nvidia-smi dmon -s t`, and per-process
utilization entries. Each test prints what the driver answered, for the record (`pytest -s`)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from exporter.collectors.nvlink import ALL_LINKS
from stack import processes
from tests.support.exporter import scraped

pytestmark = pytest.mark.gpu
pynvml = pytest.importorskip("pynvml")

#: field id -> name, scope: every field whose width or presence decides which reading the exporter uses
FIELDS = {(197, 0): "PCIE_COUNT_TX_BYTES", (198, 0): "PCIE_COUNT_RX_BYTES", (83, 0): "TOTAL_ENERGY_CONSUMPTION",
          (186, 0): "POWER_INSTANT", (138, ALL_LINKS): "NVLINK_THROUGHPUT_DATA_TX",
          (139, ALL_LINKS): "NVLINK_THROUGHPUT_DATA_RX", (202, ALL_LINKS): "NVLINK_COUNT_XMIT_BYTES",
          (204, ALL_LINKS): "NVLINK_COUNT_RCV_BYTES"}
ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT)
#: CUDA work for a few seconds: host-to-device copies (PCIe traffic) and matrix products (SM time)
LOAD = """
import sys, time, torch
x = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
a = torch.randn(4096, 4096, device="cuda")
end = time.time() + float(sys.argv[1])
while time.time() < end:
    x.to("cuda", non_blocking=True)
    a = (a @ a).tanh_()
torch.cuda.synchronize()
"""


def cuda_load(seconds: float) -> subprocess.Popen:
    pytest.importorskip("torch")
    import torch
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here: nothing to generate PCIe traffic and SM time with")
    return subprocess.Popen([sys.executable, "-c", LOAD, str(seconds)])


def scrape(exporter: processes.Service) -> dict[str, list]:
    return scraped(exporter.url)


def test_field_widths_and_returns_are_ones_the_exporter_handles():
    pynvml.nvmlInit()
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            values = pynvml.nvmlDeviceGetFieldValues(handle, list(FIELDS))
            answered = {FIELDS[(v.fieldId, v.scopeId)]: (v.nvmlReturn, v.valueType) for v in values}
            print(f"GPU {index} {pynvml.nvmlDeviceGetName(handle)}: {{field: (return, valueType)}} = {answered}")
            for name, (returned, value_type) in answered.items():
                assert returned == pynvml.NVML_SUCCESS or returned in ABSENT, (name, returned)
                if returned == pynvml.NVML_SUCCESS and "BYTES" in name:  # unsigned: int (32) or long long (64)
                    assert value_type in (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                                          pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG), (name, value_type)
            nvlink = [answered[n][0] == pynvml.NVML_SUCCESS for n in ("NVLINK_THROUGHPUT_DATA_TX",
                                                                       "NVLINK_COUNT_XMIT_BYTES")]
            print(f"GPU {index}: NVLink counters in the older fields, in NVLink5's: {nvlink}")
    finally:
        pynvml.nvmlShutdown()


def test_pcie_rate_matches_nvidia_smi_dmon(tmp_path, start_service):
    exporter = start_service(processes.exporter(tmp_path, ["--sample-interval=1s", "--no-collector.xid"]))
    load = cuda_load(20)
    try:
        time.sleep(5)  # CUDA is up and copying
        dmon = subprocess.Popen(["nvidia-smi", "dmon", "-s", "t", "-c", "6", "-i", "0"], stdout=subprocess.PIPE,
                                text=True)
        ours = []
        for _ in range(6):  # the same seconds as dmon's
            time.sleep(1)
            ours.append({s.labels["direction"]: s.value for s in scrape(exporter).get(
                "nvml_gpu_pcie_throughput_bytes_per_second", []) if s.labels["gpu"] == "0"})
        dmon = dmon.communicate(timeout=30)[0]
    finally:
        load.wait(timeout=60)
    header = next(line for line in dmon.splitlines() if line.startswith("#") and "rxpci" in line).split()[1:]
    rows = [dict(zip(header, line.split())) for line in dmon.splitlines() if not line.startswith("#")]
    smi = {direction: sum(float(r[f"{direction}pci"]) for r in rows) / len(rows) * 1e6 for direction in ("rx", "tx")}
    mean = {direction: sum(o.get(direction, 0.0) for o in ours) / len(ours) for direction in ("rx", "tx")}
    print(f"nvidia-smi dmon -s t (B/s): {smi}; exporter (B/s): {mean}")
    assert smi["rx"] > 1e9, "the load made no PCIe traffic to compare"
    for direction in ("rx", "tx"):
        assert mean[direction] == pytest.approx(smi[direction], rel=0.3, abs=100e6), direction


def test_process_utilization_names_a_computing_process_and_an_idle_answer_is_no_error(tmp_path, start_service):
    exporter = start_service(processes.exporter(tmp_path, ["--sample-interval=1s", "--no-collector.xid"]))
    load = cuda_load(25)
    try:
        def busy() -> float | None:
            found = [s.value for s in scrape(exporter).get("nvml_gpu_process_sm_utilization_ratio", [])
                     if s.labels["pid"] == str(load.pid)]
            return found[0] if found and found[0] > 0 else None
        ratio = processes.wait_until(busy, timeout=24, what="the computing process's SM utilization")
        print(f"process {load.pid}: nvml_gpu_process_sm_utilization_ratio {ratio}")
    finally:
        load.wait(timeout=60)
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        newest = int(time.time() * 1e6)
        try:
            answer = pynvml.nvmlDeviceGetProcessUtilization(handle, newest)
            print(f"an idle GPU's process utilization: {len([s for s in answer if s.pid])} entries")
        except pynvml.NVMLError as exc:
            print(f"an idle GPU's process utilization raises NVMLError({exc.value})")
            assert exc.value in (pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_FOUND)
    finally:
        pynvml.nvmlShutdown()
    errors = [s for s in scrape(exporter).get("nvml_exporter_errors_total", []) if s.labels["collector"] == "processes"]
    assert errors == []
