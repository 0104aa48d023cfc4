"""Counters a user can trust on real drivers: 32-bit PCIe counters, fields that appear late, NVLink5,
power as a mean, per-process utilization without samples, cadences in seconds (simulated NVML, fake clock)."""
from __future__ import annotations

import json

import pytest

from exporter.nvml import REPROBE_AFTER
from exporter.simulated import PCIE_32_BIT, PCIE_RX_BUSY_RATE, PCIE_RX_RATE, PCIE_TX_RATE, DeviceTraits, H
from tests.support.exporter import Rig
from tests.support.nvml_faults import Fault, load_fault_plan


def pcie(rig: Rig, direction: str) -> float | None:
    return rig.value("nvml_gpu_pcie_throughput_bytes_per_second", gpu="0", uuid=rig.sampler.devices[0].uuid,
                     direction=direction)


@pytest.mark.parametrize("gpm", [True, False], ids=["gpm", "no-gpm"])
def test_pcie_counters_answered_at_32_bits_give_the_true_rate_not_an_aliased_one(gpm):
    # healthy: ~5.5 GB/s received, more than a 32-bit counter holds: it wraps between two 1 s readings
    rig = Rig(gpus=1, collectors=["pcie"], devices={0: DeviceTraits(gpm=gpm, field_types=PCIE_32_BIT)})
    for _ in range(4):
        rig.step()
    busy = rig.lib.workload.utilization(0, rig.clock() - rig.lib.start)
    assert pcie(rig, "rx") == pytest.approx(PCIE_RX_RATE + PCIE_RX_BUSY_RATE * busy, rel=0.02)
    assert pcie(rig, "tx") == pytest.approx(PCIE_TX_RATE, rel=0.01)
    assert (rig.lib.calls["nvmlDeviceGetPcieThroughput"] > 0) is not gpm  # GPM first where the GPU has it
    assert rig.series("nvml_exporter_errors_total") == []


def test_pcie_counters_answered_at_64_bits_are_still_read_from_the_fields():
    rig = Rig(gpus=1, collectors=["pcie"])
    for _ in range(3):
        rig.step()
    assert pcie(rig, "tx") == pytest.approx(PCIE_TX_RATE, rel=1e-3)
    assert rig.lib.calls["nvmlDeviceGetPcieThroughput"] == 0 and rig.lib.calls["nvmlGpmSampleGet"] == 0


def test_readings_absent_at_start_are_asked_again_and_exported_once_they_appear():
    # NVLink fields answer NOT_SUPPORTED until the fabric manager is up (60 s in); the clocks likewise
    late = [Fault(field=H.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, error="NotSupported", until=60),
            Fault(field=H.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, error="NotSupported", until=60),
            Fault(function="nvmlDeviceGetClockInfo", error="NotSupported", until=60)]
    rig = Rig(gpus=1, collectors=["nvlink", "clocks"], faults=late)
    for _ in range(3):
        rig.step()
    assert rig.series("nvml_gpu_nvlink_data_bytes_total") == [] and rig.series("nvml_gpu_clock_hertz") == []
    rig.step(70)
    assert rig.series("nvml_gpu_nvlink_data_bytes_total") == []  # not asked again yet: no call per sample
    rig.step(REPROBE_AFTER)
    for _ in range(10):
        rig.step()
    assert {s["direction"] for s in rig.series("nvml_gpu_nvlink_data_bytes_total")} == {"rx", "tx"}
    assert {s["clock"] for s in rig.series("nvml_gpu_clock_hertz")} == {"graphics", "sm", "memory", "video"}
    assert rig.series("nvml_exporter_errors_total") == []


def test_nvlink5_counters_are_read_where_the_older_fields_are_unsupported():
    rig = Rig(gpus=1, collectors=["nvlink"], devices={0: DeviceTraits(name="NVIDIA B200", nvlink5=True)})
    for _ in range(3):
        rig.step()
    busy = rig.lib.workload.busy_seconds(0, rig.clock() - rig.lib.start)
    for direction in ("tx", "rx"):
        assert rig.value("nvml_gpu_nvlink_data_bytes_total", gpu="0", uuid=rig.sampler.devices[0].uuid,
                         direction=direction) == pytest.approx(20e9 * busy, rel=1e-6)
    assert rig.series("nvml_exporter_errors_total") == []


def test_power_is_the_mean_over_the_sample_from_the_energy_counter_and_the_instant_reading_has_its_own_name():
    # input-bound: 2 s at full power, 2 s idle; 1.5 s samples straddle both
    rig = Rig("input-bound", gpus=1, collectors=["power"], interval=1.5)
    uuid = rig.sampler.devices[0].uuid
    differ = 0
    rig.step()
    for _ in range(12):
        before = rig.value("nvml_gpu_energy_joules_total", gpu="0", uuid=uuid)
        rig.step()
        mean = (rig.value("nvml_gpu_energy_joules_total", gpu="0", uuid=uuid) - before) / 1.5
        assert rig.value("nvml_gpu_power_usage_watts", gpu="0", uuid=uuid) == pytest.approx(mean, abs=0.01)
        instant = rig.value("nvml_gpu_power_instant_watts", gpu="0", uuid=uuid)
        differ += abs(instant - mean) > 50
        assert 90 <= instant <= 650
    assert differ >= 3  # an instant is not the mean whenever the load changed within the sample


def test_power_without_an_energy_counter_is_the_instant_reading():
    faults = [Fault(field=H.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, error="NotSupported"),
              Fault(function="nvmlDeviceGetTotalEnergyConsumption", error="NotSupported")]
    rig = Rig(gpus=1, collectors=["power"], faults=faults)
    for _ in range(3):
        rig.step()
    uuid = rig.sampler.devices[0].uuid
    assert rig.value("nvml_gpu_power_usage_watts", gpu="0", uuid=uuid) == \
        rig.value("nvml_gpu_power_instant_watts", gpu="0", uuid=uuid) > 500


def test_process_utilization_answered_success_without_samples_is_no_error():
    # processes that compute nothing: the driver has no per-process sample, and its SUCCESS reaches
    # pynvml's caller as NVMLError(0)
    rig = Rig(gpus=1, collectors=["processes"])
    rig.lib.process_sm = lambda gpu, pids, t: {}
    for _ in range(11):
        rig.step()
    [labels] = rig.series("nvml_gpu_process_sm_utilization_ratio")
    assert rig.value("nvml_gpu_process_sm_utilization_ratio", **labels) == 0
    assert rig.lib.calls["nvmlDeviceGetProcessUtilization"] == 3
    assert rig.series("nvml_exporter_errors_total") == []
    assert rig.value("nvml_exporter_collector_success", collector="processes") == 1


def test_cadences_are_seconds_so_a_5_s_interval_reads_memory_at_every_sample():
    rig = Rig(gpus=1, collectors=["memory", "clocks"], interval=5.0)
    for _ in range(4):
        rig.step()
    assert rig.lib.calls["nvmlDeviceGetMemoryInfo"] == 4  # a 5 s period: every 5 s sample, not every 25 s
    clocks = rig.lib.calls["nvmlDeviceGetClockInfo"]
    assert clocks == 2 * 4  # a 10 s period: every other sample, four clocks each


def test_a_fault_plan_answers_pcie_counters_at_32_bits(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"devices": {"0": {"field_types": {"197": 1, "198": 1}, "gpm": False}}}))
    devices, _ = load_fault_plan(str(plan))
    assert devices[0].field_types == PCIE_32_BIT
    rig = Rig(gpus=1, collectors=["pcie"], devices=devices)
    for _ in range(3):
        rig.step()
    busy = rig.lib.workload.utilization(0, rig.clock() - rig.lib.start)
    assert pcie(rig, "rx") == pytest.approx(PCIE_RX_RATE + PCIE_RX_BUSY_RATE * busy, rel=0.02)
