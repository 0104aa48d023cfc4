"""What real drivers answer at the edges: an old driver under a new binding, GPM NaN and GPM counters
across a GPU loss, an event set left undefined by a failed registration, the driver's sample spacing."""
from __future__ import annotations

import logging
import math

import pynvml

from exporter.simulated import DeviceTraits, H
from stack.processes import wait_until
from tests.support.exporter import Rig
from tests.support.nvml_faults import Fault

GPM_RATIOS = ("nvml_gpu_sm_active_ratio", "nvml_gpu_tensor_active_ratio", "nvml_gpu_dram_active_ratio")


def test_an_old_driver_under_a_new_binding_has_no_process_list_and_no_traceback(caplog):
    # R470/R510 lack nvmlDeviceGetComputeRunningProcesses_v3; nvidia-ml-py >= 12.560 then raises
    # NVMLLibraryMismatchError, a plain Exception, not an NVMLError
    caplog.set_level(logging.WARNING)
    rig = Rig(gpus=1, collectors=["processes", "memory"], driver_lacks=("nvmlDeviceGetComputeRunningProcesses_v3",))
    try:
        rig.lib.nvmlDeviceGetComputeRunningProcesses(rig.lib.nvmlDeviceGetHandleByIndex(0))
    except Exception as exc:  # noqa: BLE001 - what the fake answers, as the binding does
        answered = exc
    assert type(answered).__name__ == ("NVMLLibraryMismatchError" if hasattr(pynvml, "NVMLLibraryMismatchError")
                                       else "NVMLError_FunctionNotFound")
    for _ in range(3):
        rig.step()
    assert rig.series("nvml_gpu_process_memory_used_bytes") == []
    assert rig.value("nvml_exporter_collector_success", collector="processes") == 1  # absent, not failed
    assert rig.series("nvml_exporter_errors_total") == []
    assert rig.lib.calls["nvmlDeviceGetComputeRunningProcesses"] == 2  # the probe above, then once: remembered
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


def gpm_windows(rig: Rig, seconds: float = 1.0, samples: int = 12) -> list[dict[str, float]]:
    """The GPM ratios served after each of `samples` samples `seconds` apart."""
    served = []
    for _ in range(samples):
        rig.step(seconds)
        served.append({name: rig.value(name, gpu="0", uuid=rig.sampler.devices[0].uuid) for name in GPM_RATIOS})
    return served


def test_a_gpm_metric_the_driver_answers_nan_for_is_absent():
    rig = Rig(gpus=1, collectors=["gpm"], devices={0: DeviceTraits(gpm_nan_metrics=(H.NVML_GPM_METRIC_DRAM_BW_UTIL,))})
    served = gpm_windows(rig)
    assert any(ratios["nvml_gpu_sm_active_ratio"] for ratios in served)
    assert all(ratios["nvml_gpu_dram_active_ratio"] is None for ratios in served), served
    assert "NaN" not in rig.exposition()


def test_the_gpm_window_starts_again_after_the_gpu_was_lost():
    # lost from t = 12 s to 14 s: its GPM counters start again from zero, so a window over the loss is garbage
    rig = Rig(gpus=1, collectors=["gpm", "memory"],
              faults=[Fault(gpu=0, function="*", error="GpuIsLost", at=12, until=14)])
    served = gpm_windows(rig, samples=30)
    assert rig.sampler.gpus[0].lost is False and rig.lib.calls["nvmlGpmMetricsGet"] >= 3
    values = [value for ratios in served for value in ratios.values() if value is not None]
    assert values and all(0 <= value <= 1 and not math.isnan(value) for value in values), served
    assert served[-1]["nvml_gpu_sm_active_ratio"]  # and it is served again after the loss


def test_an_event_set_a_gpu_failed_to_register_on_with_unknown_is_freed_and_the_others_keep_counting():
    faults = [Fault(gpu=1, function="nvmlDeviceRegisterEvents", error="Unknown"), Fault(gpu=0, xid=48, times=1)]
    rig = Rig(gpus=2, faults=faults, collectors=["xid"])
    rig.sampler.xid.start()
    try:
        uuid = rig.sampler.devices[0].uuid
        wait_until(lambda: rig.step(0.01) or rig.value("nvml_gpu_xid_errors_total", gpu="0", uuid=uuid,
                                                           xid="48", gpu_instance=""),
                   timeout=10, what="GPU 0's XID counted")
        assert len(rig.lib._event_sets) == 1
        assert rig.lib.calls["nvmlEventSetFree"] == rig.lib.calls["nvmlEventSetCreate"] - 1
    finally:
        assert rig.sampler.stop()
    assert rig.lib._event_sets == {}


def test_the_fake_drivers_samples_are_spaced_as_a_real_drivers():
    rig = Rig(gpus=1, collectors=["utilization"])
    rig.step(10.0)
    _, samples = rig.lib.nvmlDeviceGetSamples(rig.lib.nvmlDeviceGetHandleByIndex(0), H.NVML_GPU_UTILIZATION_SAMPLES, 0)
    stamps = [sample.timeStamp for sample in samples]
    spacing = (stamps[-1] - stamps[0]) / (len(stamps) - 1) / 1e6
    assert 1 / 6 * 0.9 <= spacing <= 1.0, spacing  # NVML: 1/6 s to 1 s depending on the product
