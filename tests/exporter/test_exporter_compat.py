"""The exporter on older nvidia-ml-py bindings, and binding bugs told apart from absent readings."""
from __future__ import annotations

import logging

from exporter.simulated import DeviceTraits, H
from tests.support.exporter import Rig

# What nvidia-ml-py 12.535.108 (the declared floor) lacks of what the exporter reads.
OLD_BINDING = ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES")


def test_binding_without_newer_constants_starts_and_reads_pcie_byte_counters():
    rig = Rig("healthy", gpus=1, collectors=["pcie", "utilization"], binding_lacks=OLD_BINDING)
    rig.step()
    rig.step()
    uuid = rig.sampler.devices[0].uuid
    # the driver still has the fields: read with their nvml.h ids, not the 20 ms throughput fallback
    assert rig.value("nvml_gpu_pcie_throughput_bytes_per_second", gpu="0", uuid=uuid, direction="tx") > 0
    assert rig.lib.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_function_missing_from_the_binding_is_absent_and_the_older_one_is_used():
    rig = Rig("healthy", gpus=1, collectors=["throttle"], binding_lacks=("nvmlDeviceGetCurrentClocksEventReasons",))
    rig.step()
    rig.step()
    assert rig.value("nvml_gpu_throttle_active", gpu="0", uuid=rig.sampler.devices[0].uuid, reason="gpu_idle") == 0
    assert rig.lib.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2
    assert rig.value("nvml_exporter_errors_total", collector="throttle", error="not_in_binding") is None


def test_attribute_error_inside_the_binding_is_a_logged_bug_not_an_absent_reading(caplog):
    rig = Rig("healthy", gpus=1, collectors=["thermal"])

    def broken(handle, sensor, version=0x100000C):
        raise AttributeError("module 'pynvml' has no attribute 'NVML_SOMETHING_NEW'")
    rig.lib.nvmlDeviceGetTemperatureV = broken
    with caplog.at_level(logging.ERROR):
        for _ in range(21):  # thermal runs every 10th sample: three runs
            rig.step()
    assert rig.value("nvml_exporter_errors_total", collector="thermal", error="binding_error") == 3
    assert len([r for r in caplog.records if "bug" in r.getMessage()]) == 1  # once, with its traceback
    assert not rig.sampler.devices[0].lacks("nvmlDeviceGetTemperatureV", rig.lib.NVML_TEMPERATURE_GPU)


def test_a_field_answered_as_unsigned_short_on_a_binding_without_usval_fails_nothing():
    # nvidia-ml-py 12.535.108's c_nvmlValue_t has no usVal; the driver may still answer type 6
    memory_temp_as_short = DeviceTraits(field_types={H.NVML_FI_DEV_MEMORY_TEMP: H.NVML_VALUE_TYPE_UNSIGNED_SHORT})
    rig = Rig("healthy", gpus=2, collectors=["thermal", "power", "memory"], devices={0: memory_temp_as_short},
              binding_lacks=OLD_BINDING + ("usVal",))
    rig.step()
    rig.step()
    for gpu in rig.sampler.devices:
        assert 40 <= rig.value("nvml_gpu_memory_temperature_celsius", gpu=str(gpu.index), uuid=gpu.uuid) <= 60
        assert rig.value("nvml_gpu_power_usage_watts", gpu=str(gpu.index), uuid=gpu.uuid) > 0
    assert rig.series("nvml_exporter_errors_total") == []
