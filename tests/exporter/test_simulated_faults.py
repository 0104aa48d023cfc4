"""The simulator's fault scenarios (thermal-throttle, xid, co-tenant): what `dualtrack explain`
names, served through the exporter's real sampler and collectors."""
from __future__ import annotations

import pynvml
import pytest

from exporter.simulated import CO_TENANT_BYTES, CO_TENANT_PID, FAULT_AFTER, DeviceTraits, H, SimulatedNVML
from tests.support.exporter import FakeClock, Rig
from tests.support.nvml_faults import Fault, FaultyNVML


def test_thermal_throttle_slows_the_clock_and_counts_thermal_seconds():
    rig = Rig(["healthy", "thermal-throttle"], 2)
    rig.step(FAULT_AFTER - 5)
    assert rig.value("nvml_gpu_throttle_active", gpu="1", uuid=rig.lib._uuids[1], reason="sw_thermal_slowdown") == 0
    for _ in range(10):
        rig.step()
    labels = {"gpu": "1", "uuid": rig.lib._uuids[1]}
    assert rig.value("nvml_gpu_throttle_active", **labels, reason="sw_thermal_slowdown") == 1
    assert rig.value("nvml_gpu_throttle_seconds_total", **labels, reason="sw_thermal_slowdown") >= 5
    clocks = [s for s in rig.series("nvml_gpu_clock_hertz") if s["clock"] == "sm"]
    assert clocks, "no SM clock served"
    assert rig.value("nvml_gpu_clock_hertz", **labels, clock="sm") == 1200e6
    assert rig.value("nvml_gpu_clock_hertz", gpu="0", uuid=rig.lib._uuids[0], clock="sm") == 1980e6
    assert rig.value("nvml_gpu_throttle_active", gpu="0", uuid=rig.lib._uuids[0], reason="sw_thermal_slowdown") == 0


def test_co_tenant_adds_a_foreign_process_and_its_memory():
    rig = Rig(["co-tenant"], 1, pid=1000)
    rig.step()
    before = rig.value("nvml_gpu_memory_used_bytes", gpu="0", uuid=rig.lib._uuids[0])
    assert {s["pid"] for s in rig.series("nvml_gpu_process_memory_used_bytes")} == {"1000"}
    for _ in range(int(FAULT_AFTER) + 5):
        rig.step()
    assert {s["pid"] for s in rig.series("nvml_gpu_process_memory_used_bytes")} == {"1000", str(CO_TENANT_PID)}
    assert rig.value("nvml_gpu_memory_used_bytes", gpu="0", uuid=rig.lib._uuids[0]) == before + CO_TENANT_BYTES


def test_the_co_tenant_computes_and_per_process_samples_come_as_from_a_driver():
    """nvmlDeviceGetProcessUtilization as a driver answers it: samples newer than the timestamp
    (CPU microseconds), per process, not in time order, padded with empty entries; NOT_FOUND when
    none is newer; NOT_SUPPORTED in MIG mode and on boards without it. The co-tenant takes 40 % of
    the SMs once its fault starts."""
    clock = FakeClock()
    lib = FaultyNVML(["co-tenant", "healthy", "healthy"], 3, pid=1000, clock=clock,
                     devices={1: DeviceTraits(mig=True), 2: DeviceTraits(process_utilization=False)})
    lib.nvmlInit()
    gpu0, gpu1, gpu2 = (lib.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    for handle in (gpu1, gpu2):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            lib.nvmlDeviceGetProcessUtilization(handle, 0)
    clock.advance(10)
    samples = lib.nvmlDeviceGetProcessUtilization(gpu0, 0)
    real = [s for s in samples if s.pid]
    assert {s.pid for s in real} == {1000} and len(samples) > len(real)  # padded
    assert all(s.timeStamp == 0 for s in samples if not s.pid)
    assert all(90 <= s.smUtil <= 97 for s in real)
    newest = max(s.timeStamp for s in real)
    assert newest <= clock() * 1e6
    with pytest.raises(pynvml.NVMLError) as nothing_newer:  # SUCCESS with no samples, as pynvml raises it
        lib.nvmlDeviceGetProcessUtilization(gpu0, newest)
    assert nothing_newer.value.value == pynvml.NVML_SUCCESS
    clock.advance(FAULT_AFTER)
    samples = [s for s in lib.nvmlDeviceGetProcessUtilization(gpu0, newest) if s.pid]
    assert all(s.timeStamp > newest for s in samples)
    assert {s.smUtil for s in samples if s.pid == CO_TENANT_PID} == {40}
    assert [s.timeStamp for s in samples] != sorted(s.timeStamp for s in samples)  # no time order
    lib.nvmlShutdown()


def test_xid_scenario_sends_one_xid_79_after_the_healthy_start():
    clock = FakeClock()
    lib = FaultyNVML(["xid", "healthy"], 2, clock=clock)
    lib.nvmlInit()
    events = lib.nvmlEventSetCreate()
    for gpu in range(2):
        lib.nvmlDeviceRegisterEvents(lib.nvmlDeviceGetHandleByIndex(gpu), lib.nvmlEventTypeXidCriticalError, events)
    with pytest.raises(pynvml.NVMLError_Timeout):
        lib.nvmlEventSetWait(events, 0)
    clock.advance(FAULT_AFTER)
    event = lib.nvmlEventSetWait(events, 0)
    assert event.eventData == 79 and lib._gpu_of(event.device) == 0
    with pytest.raises(pynvml.NVMLError_Timeout):  # once, not a storm
        lib.nvmlEventSetWait(events, 0)
    lib.nvmlShutdown()


def test_a_gpu_off_the_bus_fails_every_wait_on_its_event_sets_and_restarts_its_gpm_counters():
    clock = FakeClock()
    lib = FaultyNVML("healthy", 2, clock=clock, faults=[Fault(gpu=1, function="*", error="GpuIsLost", at=5, until=6)])
    lib.nvmlInit()
    gpus = [lib.nvmlDeviceGetHandleByIndex(gpu) for gpu in range(2)]
    events = lib.nvmlEventSetCreate()
    for handle in gpus:
        lib.nvmlDeviceRegisterEvents(handle, lib.nvmlEventTypeXidCriticalError, events)
    before, after = lib.nvmlGpmSampleAlloc(), lib.nvmlGpmSampleAlloc()
    clock.advance(4)
    lib.nvmlGpmSampleGet(gpus[1], before)
    with pytest.raises(pynvml.NVMLError_Timeout):
        lib.nvmlEventSetWait(events, 0)
    clock.advance(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        lib.nvmlDeviceGetTemperatureV(gpus[1], pynvml.NVML_TEMPERATURE_GPU)
    clock.advance(2)  # back on the bus; GPU 0 never left, and the set still answers for GPU 1
    lib.nvmlGpmSampleGet(gpus[1], after)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        lib.nvmlEventSetWait(events, 0)
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version, request.numMetrics = H.NVML_GPM_METRICS_GET_VERSION, 1
    request.sample1, request.sample2 = before, after
    request.metrics[0].metricId = H.NVML_GPM_METRIC_SM_UTIL
    assert lib.nvmlGpmMetricsGet(request).metrics[0].value < 0  # across the restart, garbage, as from a driver
    lib.nvmlShutdown()


def test_unknown_scenario_names_the_new_ones():
    with pytest.raises(ValueError, match="thermal-throttle, xid, co-tenant"):
        SimulatedNVML("overheat", 1)
