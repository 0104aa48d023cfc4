"""The simulated NVML's scenarios behave as documented (what demos and dashboard previews show)."""
from __future__ import annotations

import threading

import pynvml
import pytest

from exporter.simulated import GIB, DeviceTraits, H, SimulatedNVML
from stack.processes import wait_until
from tests.support.exporter import FakeClock
from tests.support.nvml_faults import FaultPlanError, FaultyNVML, load_fault_plan


def test_input_bound_swings_two_seconds_busy_two_idle_and_power_follows():
    lib = SimulatedNVML("input-bound", 1)
    assert [lib.workload.utilization(0, t) for t in (0.5, 1.5, 2.5, 3.5, 4.5)] == [1, 1, 0, 0, 1]
    assert lib.workload.power_mw(0, 0.5) > 600_000 > 100_000 > lib.workload.power_mw(0, 2.5)


def test_memory_leak_climbs_in_steps_until_full_within_the_configured_minutes():
    lib = SimulatedNVML("memory-leak", 1, leak_minutes=30)
    total = lib.traits[0].memory_total
    used = [lib.workload.memory_used(0, minute * 60.0) for minute in range(32)]
    assert used == sorted(used) and used[0] < total / 2
    assert lib.workload.memory_used(0, 10.0) == lib.workload.memory_used(0, 20.0)  # steps, not a ramp
    assert used[30] >= total - GIB


def test_demo_cycles_healthy_input_bound_memory_leak():
    lib = SimulatedNVML("demo", 1, phase_seconds=100)
    assert lib.workload.utilization(0, 50.5) > 0.85 and lib.workload.utilization(0, 50.6) > 0.85          # healthy
    assert {lib.workload.utilization(0, 100.5), lib.workload.utilization(0, 102.5)} == {1.0, 0.0}         # input-bound
    assert lib.workload.memory_used(0, 290.0) > lib.workload.memory_used(0, 210.0)                       # memory leak
    assert lib.workload.utilization(0, 350.5) > 0.85                                            # healthy again


def test_structs_and_errors_are_pynvmls_own():
    clock = FakeClock()
    lib = FaultyNVML("healthy", 1, clock=clock)
    lib.nvmlInit()
    handle = lib.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(lib.nvmlDeviceGetMemoryInfo(handle, pynvml.nvmlMemory_v2), pynvml.c_nvmlMemory_v2_t)
    assert isinstance(lib.nvmlDeviceGetUtilizationRates(handle), pynvml.c_nvmlUtilization_t)
    assert isinstance(lib.nvmlDeviceGetFieldValues(handle, [H.NVML_FI_DEV_POWER_INSTANT])[0],
                      pynvml.c_nvmlFieldValue_t)
    clock.advance(1.0)
    kind, samples = lib.nvmlDeviceGetSamples(handle, H.NVML_GPU_UTILIZATION_SAMPLES, 0)
    assert kind == H.NVML_VALUE_TYPE_UNSIGNED_INT and isinstance(samples[0], pynvml.c_nvmlSample_t)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetNumFans(handle)
    assert not hasattr(lib, "nvmlDeviceGetBAR1MemoryInfo")  # a pynvml function the simulation lacks looks missing


def test_fault_plan_errors_are_one_line(tmp_path):
    bad = tmp_path / "faults.json"
    bad.write_text('{"faults": [{"gpu": 0, "error": "Sunspots"}]}')
    with pytest.raises(FaultPlanError, match="unknown NVML error"):
        load_fault_plan(str(bad))
    bad.write_text('{"devices": {"0": {"wings": 2}}}')
    with pytest.raises(FaultPlanError, match="unknown device trait"):
        load_fault_plan(str(bad))
    bad.write_text("{")
    with pytest.raises(FaultPlanError) as error:
        load_fault_plan(str(bad))
    assert "\n" not in str(error.value)


def test_every_simulated_function_has_pynvmls_signature():
    import inspect
    lib = SimulatedNVML("healthy", 1)
    lib.nvmlInit()
    simulated = [name for name in dir(type(lib)) if name.startswith("nvml") and callable(getattr(type(lib), name))]
    assert len(simulated) > 30
    for name in simulated:
        if not hasattr(pynvml, name):  # newer than the installed nvidia-ml-py
            continue
        real = [p.name for p in inspect.signature(getattr(pynvml, name)).parameters.values()]
        ours = [p.name for p in inspect.signature(getattr(lib, name)).parameters.values()]
        assert len(ours) == len(real), (name, ours, real)
    with pytest.raises(TypeError):  # pynvml hands this argument to ctypes.c_char_p: str is refused
        lib.nvmlDeviceGetHandleByUUID(lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetHandleByIndex(0)))


def test_out_of_range_nvlink_ids_answer_invalid_argument_and_missing_links_not_supported():
    lib = SimulatedNVML("healthy", 1, devices={0: DeviceTraits(nvlinks=12)})
    lib.nvmlInit()
    handle = lib.nvmlDeviceGetHandleByIndex(0)
    tx = H.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    answers = [v.nvmlReturn for v in lib.nvmlDeviceGetFieldValues(handle, [(tx, 11), (tx, 12), (tx, 18),
                                                                           (tx, 0xFFFFFFFF)])]
    assert answers == [H.NVML_SUCCESS, H.NVML_ERROR_NOT_SUPPORTED, H.NVML_ERROR_INVALID_ARGUMENT, H.NVML_SUCCESS]


def test_nothing_answers_before_init_or_after_shutdown_and_shutdown_frees():
    lib = SimulatedNVML("healthy", 1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        lib.nvmlDeviceGetCount()
    lib.nvmlInit()
    handle = lib.nvmlDeviceGetHandleByIndex(0)
    event_set, gpm_sample = lib.nvmlEventSetCreate(), lib.nvmlGpmSampleAlloc()
    lib.nvmlDeviceRegisterEvents(handle, H.nvmlEventTypeXidCriticalError, event_set)
    lib.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        lib.nvmlEventSetWait(event_set, 10)
    lib.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # freed by the shutdown
        lib.nvmlEventSetWait(event_set, 10)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlGpmSampleGet(handle, gpm_sample)


def test_an_event_wait_with_no_xid_to_come_blocks_instead_of_polling_and_shutdown_ends_it():
    # a driver blocks in nvmlEventSetWait; polling would cost the exporter's process CPU a GPU does not
    lib = SimulatedNVML("healthy", 1)
    lib.nvmlInit()
    events = lib.nvmlEventSetCreate()
    lib.nvmlDeviceRegisterEvents(lib.nvmlDeviceGetHandleByIndex(0), lib.nvmlEventTypeXidCriticalError, events)
    waits = []
    block = lib._shut_down.wait
    lib._shut_down.wait = lambda timeout: waits.append(timeout) or block(timeout)
    with pytest.raises(pynvml.NVMLError_Timeout):
        lib.nvmlEventSetWait(events, 200)
    assert len(waits) == 1, waits
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(
        pytest.raises(pynvml.NVMLError_Uninitialized, lib.nvmlEventSetWait, events, 60_000)))
    waiter.start()
    wait_until(lambda: len(waits) == 2, timeout=10, what="the second wait blocking")
    lib.nvmlShutdown()
    waiter.join(10)
    assert not waiter.is_alive() and outcome


def test_the_sample_buffer_read_from_a_timestamp_computes_only_the_newer_entries():
    clock = FakeClock()
    lib = FaultyNVML("healthy", 1, clock=clock)
    lib.nvmlInit()
    handle = lib.nvmlDeviceGetHandleByIndex(0)
    clock.advance(20)
    _, everything = lib.nvmlDeviceGetSamples(handle, H.NVML_GPU_UTILIZATION_SAMPLES, 0)
    since = everything[-11].timeStamp
    computed = []
    utilization = lib.workload.utilization
    lib.workload.utilization = lambda gpu, t: computed.append(t) or utilization(gpu, t)
    _, newer = lib.nvmlDeviceGetSamples(handle, H.NVML_GPU_UTILIZATION_SAMPLES, since)
    assert [s.timeStamp for s in newer] == [s.timeStamp for s in everything[-10:]]
    assert len(computed) <= 15  # not the whole buffer (120 entries)


def test_a_field_batch_reads_through_the_bindings_own_members_in_the_type_each_field_is_answered_in():
    power, temp, pcie = H.NVML_FI_DEV_POWER_INSTANT, H.NVML_FI_DEV_MEMORY_TEMP, H.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    traits = DeviceTraits(power=False, field_types={temp: H.NVML_VALUE_TYPE_DOUBLE,
                                                    pcie: H.NVML_VALUE_TYPE_UNSIGNED_INT})
    clock = FakeClock()
    lib = FaultyNVML("healthy", 1, devices={0: traits}, clock=clock)
    lib.nvmlInit()
    clock.advance(3.0)
    entries = lib.nvmlDeviceGetFieldValues(lib.nvmlDeviceGetHandleByIndex(0), [temp, (pcie, 0), power])
    assert [(e.fieldId, e.scopeId, e.nvmlReturn) for e in entries] == [
        (temp, 0, H.NVML_SUCCESS), (pcie, 0, H.NVML_SUCCESS), (power, 0, H.NVML_ERROR_NOT_SUPPORTED)]
    assert {e.timestamp for e in entries} == {int(clock.now * 1e6)}
    assert entries[0].valueType == H.NVML_VALUE_TYPE_DOUBLE and 40 <= entries[0].value.dVal <= 60
    # the 64-bit counter, answered as a 32-bit one, wraps at 2**32 as the driver's does
    assert entries[1].valueType == H.NVML_VALUE_TYPE_UNSIGNED_INT
    assert entries[1].value.uiVal == lib._field(0, pcie, 0, 3.0, lib.workload.busy_seconds(0, 3.0)) % 2**32
