"""MIG without privilege: what the shipped deployments (no CAP_SYS_ADMIN) get from a GPU in MIG mode.

nvml.h: on a MIG-enabled GPU the parent handle's memory and process lists need "appropriate
privileges" (the driver checks CAP_SYS_ADMIN); the simulator answers NO_PERMISSION there unless it is
told its caller is privileged, and answers on the MIG devices' own handles.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from exporter.collectors.identity import MIG_MODE_SECONDS
from exporter.simulated import DeviceTraits
from tests.support.exporter import Rig
from tests.support.nvml_faults import Fault, FaultyNVML


def test_the_simulator_refuses_a_mig_gpus_parent_memory_and_processes_unless_privileged():
    for privileged in (False, True):
        lib = FaultyNVML("healthy", 2, devices={1: DeviceTraits(mig=True)}, privileged=privileged)
        lib.nvmlInit()
        whole, mig = (lib.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        assert lib.nvmlDeviceGetMemoryInfo(whole).total > 0 and lib.nvmlDeviceGetComputeRunningProcesses(whole)
        instance = lib.nvmlDeviceGetMigDeviceHandleByIndex(mig, 0)
        assert lib.nvmlDeviceGetMemoryInfo(instance).total > 0  # a MIG device's own memory needs nothing
        for read in (lib.nvmlDeviceGetMemoryInfo, lib.nvmlDeviceGetComputeRunningProcesses):
            if privileged:
                read(mig)
            else:
                with pytest.raises(lib.NVMLError_NoPermission):
                    read(mig)


def test_unprivileged_a_mig_gpus_memory_is_the_sum_of_its_instances_and_no_error():
    """NO_PERMISSION on the parent's memory is no failure: nvml_gpu_memory_* of the GPU is the sum over
    its GPU instances (the memory alerts keep working); its processes are not listed, also no error."""
    rig = Rig(gpus=2, devices={1: DeviceTraits(mig=True)}, collectors=["memory", "mig", "processes"])
    for _ in range(6):
        rig.step()
    uuid = rig.sampler.devices[1].uuid
    for kind in ("used", "total"):
        instances = [rig.value(f"nvml_gpu_mig_memory_{kind}_bytes", **s)
                     for s in rig.series(f"nvml_gpu_mig_memory_{kind}_bytes")]
        assert len(instances) == 2
        assert rig.value(f"nvml_gpu_memory_{kind}_bytes", gpu="1", uuid=uuid) == sum(instances)
    assert rig.value("nvml_gpu_memory_free_bytes", gpu="1", uuid=uuid) > 0
    assert rig.series("nvml_exporter_errors_total") == []
    assert {s["gpu"] for s in rig.series("nvml_gpu_process_memory_used_bytes")} == {"0"}
    assert rig.value("nvml_exporter_collector_success", collector="memory") == 1


def test_a_failure_other_than_no_permission_is_still_counted():
    rig = Rig(gpus=1, devices={0: DeviceTraits(mig=True)}, collectors=["memory"],
              faults=[Fault(function="nvmlDeviceGetMemoryInfo", error="Timeout")])
    rig.step()
    assert rig.value("nvml_exporter_errors_total", collector="memory", error="timeout") >= 1


def test_the_mig_mode_is_read_again_every_minute():
    """MIG turned off while the exporter runs (`nvidia-smi -mig 0`, a GPU reset): within
    MIG_MODE_SECONDS nvml_gpu_info says so, the GPU instances are gone and the whole GPU's memory is
    read again from the parent."""
    rig = Rig(gpus=1, devices={0: DeviceTraits(mig=True)}, collectors=["mig", "memory"], interval=1.0)
    for _ in range(5):
        rig.step()
    assert [s["mig_mode"] for s in rig.series("nvml_gpu_info")] == ["enabled"]
    assert rig.series("nvml_gpu_mig_info")
    rig.lib.traits[0] = replace(rig.lib.traits[0], mig=False)
    while rig.clock() - rig.lib.start < MIG_MODE_SECONDS - 5:
        rig.step()
    assert [s["mig_mode"] for s in rig.series("nvml_gpu_info")] == ["enabled"]  # not asked every sample
    for _ in range(10):
        rig.step()
    assert [s["mig_mode"] for s in rig.series("nvml_gpu_info")] == ["disabled"]
    assert rig.series("nvml_gpu_mig_info") == []
    uuid = rig.sampler.devices[0].uuid
    assert rig.value("nvml_gpu_memory_total_bytes", gpu="0", uuid=uuid) == DeviceTraits().memory_total
    assert rig.series("nvml_exporter_errors_total") == []
