"""Collectors and sampler against simulated NVML at the pynvml boundary (no daemon, fake clock)."""
from __future__ import annotations

import pytest

from exporter.nvml import Absent, CallFailed, Device, GpuLost, Nvml
from exporter.simulated import PCIE_32_BIT, PCIE_TX_RATE, DeviceTraits, H, simulated_uuid
from tests.support.exporter import EVERY_COLLECTOR, Rig, gpus_with
from tests.support.nvml_faults import Fault, FaultyNVML

CORE_METRICS = [
    "nvml_gpu_info", "nvml_gpu_utilization_ratio", "nvml_gpu_memory_controller_utilization_ratio",
    "nvml_gpu_busy_seconds_total", "nvml_gpu_idle_seconds_total", "nvml_gpu_memory_used_bytes",
    "nvml_gpu_memory_total_bytes", "nvml_gpu_memory_free_bytes", "nvml_gpu_temperature_celsius",
    "nvml_gpu_power_usage_watts", "nvml_gpu_power_limit_watts", "nvml_gpu_energy_joules_total",
    "nvml_gpu_clock_hertz", "nvml_gpu_clock_max_hertz", "nvml_gpu_performance_state",
    "nvml_gpu_pcie_throughput_bytes_per_second", "nvml_gpu_nvlink_data_bytes_total", "nvml_gpu_throttle_active",
    "nvml_gpu_throttle_seconds_total", "nvml_gpu_ecc_errors_total", "nvml_gpu_remapped_rows_total",
    "nvml_gpu_process_memory_used_bytes", "nvml_gpu_sm_active_ratio", "nvml_gpu_tensor_active_ratio",
    "nvml_gpu_dram_active_ratio",
]


def test_eight_h100s_export_every_metric_for_every_gpu():
    rig = Rig(gpus=8)
    for _ in range(6):
        rig.step()
    everyone = {str(i) for i in range(8)}
    for name in CORE_METRICS:
        assert gpus_with(rig, name) == everyone, name
    assert rig.value("nvml_up") == 1
    assert rig.value("nvml_gpu_memory_total_bytes", gpu="3", uuid=rig.sampler.devices[3].uuid) == 81559 * 2**20
    info = rig.series("nvml_gpu_info")[0]
    assert info["name"] == "NVIDIA H100 80GB HBM3" and info["simulated"] == "true"
    assert {s["reason"] for s in rig.series("nvml_gpu_throttle_active")} == {
        "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
        "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting"}
    assert {s["clock"] for s in rig.series("nvml_gpu_clock_hertz")} == {"graphics", "sm", "memory", "video"}
    # H100s retire no pages (they remap rows): no series rather than a fake 0, and no error counted.
    assert rig.series("nvml_gpu_retired_pages_total") == []
    assert rig.series("nvml_exporter_errors_total") == []
    assert all(rig.value("nvml_exporter_collector_success", collector=c) == 1 for c in EVERY_COLLECTOR)


def test_units_are_base_units():
    rig = Rig(gpus=1)
    rig.step()
    rig.step()
    uuid = rig.sampler.devices[0].uuid
    assert 0.85 < rig.value("nvml_gpu_utilization_ratio", gpu="0", uuid=uuid) <= 1.0
    assert rig.value("nvml_gpu_clock_max_hertz", gpu="0", uuid=uuid, clock="sm") == 1980e6
    assert rig.value("nvml_gpu_power_limit_watts", gpu="0", uuid=uuid) == 700
    assert 500 < rig.value("nvml_gpu_power_usage_watts", gpu="0", uuid=uuid) < 700


def test_nvml_calls_per_gpu_per_sample_stay_within_five():
    # every NVML call, the GPM metrics computation (no device argument) included, over two cycles of
    # the slowest period (10 samples)
    rig = Rig(gpus=8)
    rig.step()  # first sample also reads static identity
    calls = lambda: sum(rig.lib.calls.values())  # noqa: E731
    before = calls()
    per_sample = []
    for _ in range(20):
        start = calls()
        rig.step()
        per_sample.append((calls() - start) / 8)
    average = (calls() - before) / (20 * 8)
    assert max(per_sample) <= 8, per_sample
    assert average <= 5, average


def test_gpu_without_fan_or_power_exports_no_such_series_and_no_error():
    devices = {0: DeviceTraits(fans=2), 1: DeviceTraits(power=False)}
    rig = Rig(gpus=2, devices=devices)
    for _ in range(6):
        rig.step()
    assert {(s["gpu"], s["fan"]) for s in rig.series("nvml_gpu_fan_speed_ratio")} == {("0", "0"), ("0", "1")}
    for name in ("nvml_gpu_power_usage_watts", "nvml_gpu_power_limit_watts", "nvml_gpu_energy_joules_total"):
        assert gpus_with(rig, name) == {"0"}, name
    assert rig.series("nvml_exporter_errors_total") == []
    # The fallback functions were tried once, then never again.
    calls = rig.lib.calls["nvmlDeviceGetPowerUsage"]
    rig.step()
    assert rig.lib.calls["nvmlDeviceGetPowerUsage"] == calls == 1


def test_static_reading_that_fails_once_is_read_again():
    faults = [Fault(function="nvmlDeviceGetNumFans", error="Timeout", times=1),
              Fault(function="nvmlDeviceGetMaxClockInfo", error="Timeout", times=1),
              Fault(function="nvmlGpmQueryDeviceSupport", error="Timeout", times=1)]
    rig = Rig(gpus=1, devices={0: DeviceTraits(fans=2)}, faults=faults)
    for _ in range(16):  # fan, clocks and gpm run every 5th sample: four runs (gpm needs two samples)
        rig.step()
    assert gpus_with(rig, "nvml_gpu_sm_active_ratio") == {"0"}
    assert {s["fan"] for s in rig.series("nvml_gpu_fan_speed_ratio")} == {"0", "1"}
    assert {s["clock"] for s in rig.series("nvml_gpu_clock_max_hertz")} == {"graphics", "sm", "memory", "video"}
    assert rig.value("nvml_exporter_errors_total", collector="fan", error="timeout") == 1
    assert rig.value("nvml_exporter_errors_total", collector="clocks", error="timeout") == 1
    assert rig.lib.calls["nvmlDeviceGetMaxClockInfo"] == 5  # four, one of them twice; then never again


def test_older_driver_without_sample_buffer_or_clocks_event_reasons_falls_back():
    faults = [Fault(function="nvmlDeviceGetSamples", error="FunctionNotFound"),
              Fault(function="nvmlDeviceGetCurrentClocksEventReasons", error="FunctionNotFound")]
    rig = Rig("input-bound", gpus=1, faults=faults, interval=0.5)
    for _ in range(40):  # 20 s: five 4-second busy/idle periods, polled every 0.5 s
        rig.step()
    uuid = rig.sampler.devices[0].uuid
    busy = rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid)
    assert busy == pytest.approx(10, abs=1.0)
    idle = rig.value("nvml_gpu_throttle_seconds_total", gpu="0", uuid=uuid, reason="gpu_idle")
    assert idle == pytest.approx(10, abs=1.0)
    assert rig.lib.calls["nvmlDeviceGetSamples"] == 1
    assert rig.lib.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 40
    assert rig.series("nvml_exporter_errors_total") == []


def test_gpu_lost_mid_run_drops_only_its_series_and_comes_back():
    faults = [Fault(gpu=1, function="*", error="GpuIsLost", at=3.0, until=8.0)]
    rig = Rig(gpus=3, faults=faults)
    rig.step()
    rig.step()
    assert gpus_with(rig, "nvml_gpu_memory_used_bytes") == {"0", "1", "2"}
    rig.step(2.0)  # t = 4: lost
    uuid = rig.sampler.devices[1].uuid
    assert gpus_with(rig, "nvml_gpu_memory_used_bytes") == {"0", "2"}
    assert gpus_with(rig, "nvml_gpu_info") == {"0", "2"}
    assert rig.value("nvml_gpu_lost", gpu="1", uuid=uuid) == 1
    assert rig.value("nvml_gpu_lost", gpu="0", uuid=rig.sampler.devices[0].uuid) == 0
    assert rig.value("nvml_exporter_gpu_lost_total", gpu="1", uuid=uuid) == 1
    assert rig.value("nvml_up") == 1
    for _ in range(3):
        rig.step()  # still lost: retried, not counted again
    assert rig.value("nvml_exporter_gpu_lost_total", gpu="1", uuid=uuid) == 1
    rig.step(2.0)  # t = 9: back
    assert gpus_with(rig, "nvml_gpu_memory_used_bytes") == {"0", "1", "2"}
    assert rig.value("nvml_gpu_lost", gpu="1", uuid=uuid) == 0
    assert rig.value("nvml_exporter_gpu_lost_total", gpu="1", uuid=uuid) == 1


def test_error_on_one_field_is_counted_and_breaks_nothing_else():
    faults = [Fault(gpu=0, field=H.NVML_FI_DEV_POWER_INSTANT, error="Unknown"),
              Fault(gpu=0, function="nvmlDeviceGetTemperatureV", error="Timeout")]
    rig = Rig(gpus=2, faults=faults)
    rig.step()
    rig.step()
    assert gpus_with(rig, "nvml_gpu_power_instant_watts") == {"1"}
    assert gpus_with(rig, "nvml_gpu_power_usage_watts") == {"0", "1"}  # the mean, from the energy counter
    assert gpus_with(rig, "nvml_gpu_temperature_celsius") == {"1"}
    assert gpus_with(rig, "nvml_gpu_energy_joules_total") == {"0", "1"}
    assert gpus_with(rig, "nvml_gpu_memory_used_bytes") == {"0", "1"}
    assert rig.value("nvml_exporter_errors_total", collector="power", error="unknown") == 2
    # thermal runs on the first sample, then every 10th: once in these two
    assert rig.value("nvml_exporter_errors_total", collector="thermal", error="timeout") == 1
    assert rig.value("nvml_exporter_collector_success", collector="power") == 0
    assert rig.value("nvml_exporter_collector_success", collector="memory") == 1
    assert rig.value("nvml_gpu_lost", gpu="0", uuid=rig.sampler.devices[0].uuid) == 0


def test_unknown_error_from_one_sensor_is_a_failed_field_not_a_lost_gpu():
    rig = Rig(gpus=2, faults=[Fault(gpu=0, function="nvmlDeviceGetTemperatureV", error="Unknown")])
    for _ in range(10):
        rig.step()
        assert gpus_with(rig, "nvml_gpu_memory_used_bytes") == {"0", "1"}  # never dropped, never flapping
    uuid = rig.sampler.devices[0].uuid
    assert gpus_with(rig, "nvml_gpu_temperature_celsius") == {"1"}
    assert rig.value("nvml_gpu_lost", gpu="0", uuid=uuid) == 0
    assert rig.value("nvml_exporter_gpu_lost_total", gpu="0", uuid=uuid) == 0
    # every failed read is counted: thermal runs every 10th sample, on the same samples on both GPUs
    reads = rig.lib.calls["nvmlDeviceGetTemperatureV"] // 2
    assert reads >= 2
    assert rig.value("nvml_exporter_errors_total", collector="thermal", error="unknown") == reads


def test_pcie_byte_counters_unknown_to_the_driver_fall_back_to_the_throughput_call():
    faults = [Fault(field=H.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, error="InvalidArgument"),
              Fault(field=H.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, error="InvalidArgument")]
    rig = Rig(gpus=1, faults=faults, collectors=["pcie"], devices={0: DeviceTraits(gpm=False)})
    for _ in range(3):
        rig.step()
    uuid = rig.sampler.devices[0].uuid
    assert rig.value("nvml_gpu_pcie_throughput_bytes_per_second", gpu="0", uuid=uuid, direction="tx") > 0
    assert rig.lib.calls["nvmlDeviceGetPcieThroughput"] == 6
    assert rig.series("nvml_exporter_errors_total") == []


def test_pcie_throughput_is_followed_across_a_counter_wrap():
    rig = Rig(gpus=1, collectors=["pcie"])
    uuid = rig.sampler.devices[0].uuid
    rates = []
    for _ in range(20):  # the simulated 64-bit TX counter wraps after 12 s
        rig.step()
        rates.append(rig.value("nvml_gpu_pcie_throughput_bytes_per_second", gpu="0", uuid=uuid, direction="tx"))
    assert rates[0] is None and rates[1:] == pytest.approx([0.5e9] * 19, rel=1e-6)


def test_pcie_throughput_is_followed_across_a_32_bit_counter_wrap():
    # a driver answering the byte counter as unsigned int: it wraps at 4 GiB, every ~8.6 s at 0.5 GB/s
    narrow = DeviceTraits(field_types={H.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: H.NVML_VALUE_TYPE_UNSIGNED_INT})
    rig = Rig(gpus=1, collectors=["pcie"], devices={0: narrow})
    uuid = rig.sampler.devices[0].uuid
    rates = []
    for _ in range(20):
        rig.step()
        rates.append(rig.value("nvml_gpu_pcie_throughput_bytes_per_second", gpu="0", uuid=uuid, direction="tx"))
    assert rates[0] is None and rates[1:] == pytest.approx([0.5e9] * 19, rel=1e-6)


def test_a_64_bit_pcie_counter_reset_below_4_gib_is_no_32_bit_wrap():
    rig = Rig(gpus=1, collectors=["pcie"])
    uuid = rig.sampler.devices[0].uuid
    real = rig.lib._field

    def reloaded_at_5s(gpu, field_id, scope, t, busy):  # counts from 1 GiB, then from 0 after a driver reload
        if field_id != H.NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
            return real(gpu, field_id, scope, t, busy)
        return 2**30 + 0.5e9 * t if t < 5 else 0.5e9 * (t - 5)
    rig.lib._field = reloaded_at_5s
    rates = []
    for _ in range(8):
        rig.step()
        rates.append(rig.value("nvml_gpu_pcie_throughput_bytes_per_second", gpu="0", uuid=uuid, direction="tx"))
    # the sample across the reset has no rate (not 2**32 - 3.07e9 bytes in 1 s); then 0.5 GB/s again
    assert rates == [None, 0.5e9, 0.5e9, 0.5e9, None, 0.5e9, 0.5e9, 0.5e9]


def test_mig_gpu_exports_each_gpu_instance_and_hidden_processes_are_no_failure():
    rig = Rig(gpus=2, devices={1: DeviceTraits(mig=True)})
    for _ in range(11):  # GPM needs two samples of its 5-sample period
        rig.step()
    info = {s["gpu"]: s["mig_mode"] for s in rig.series("nvml_gpu_info")}
    assert info == {"0": "disabled", "1": "enabled"}
    # MIG mode has no whole-GPU utilization or GPM (NOT_SUPPORTED): absent, not an error, not 0.
    assert gpus_with(rig, "nvml_gpu_utilization_ratio") == {"0"}
    assert gpus_with(rig, "nvml_gpu_busy_seconds_total") == {"0"}
    assert gpus_with(rig, "nvml_gpu_sm_active_ratio") == {"0"}
    assert gpus_with(rig, "nvml_gpu_memory_used_bytes") == {"0", "1"}
    # processes answer NO_PERMISSION under MIG: no series, no error, the collector succeeds
    assert gpus_with(rig, "nvml_gpu_process_memory_used_bytes") == {"0"}
    assert rig.series("nvml_exporter_errors_total") == []
    assert rig.value("nvml_exporter_collector_success", collector="processes") == 1
    uuid = rig.sampler.devices[1].uuid
    mig = {s["gpu_instance"]: s["mig_uuid"] for s in rig.series("nvml_gpu_mig_info")}
    assert sorted(mig) == ["1", "2"] and all(value.startswith("MIG-") for value in mig.values())
    assert {s["gpu"] for s in rig.series("nvml_gpu_mig_info")} == {"1"}
    for gi in ("1", "2"):
        used = rig.value("nvml_gpu_mig_memory_used_bytes", gpu="1", uuid=uuid, gpu_instance=gi)
        total = rig.value("nvml_gpu_mig_memory_total_bytes", gpu="1", uuid=uuid, gpu_instance=gi)
        assert 0 < used < total <= rig.lib.traits[1].memory_total / 2
        assert 0.5 < rig.value("nvml_gpu_mig_sm_active_ratio", gpu="1", uuid=uuid, gpu_instance=gi) <= 1
        assert rig.value("nvml_gpu_mig_tensor_active_ratio", gpu="1", uuid=uuid, gpu_instance=gi) > 0
    assert rig.series("nvml_gpu_mig_utilization_ratio") == []  # NOT_SUPPORTED for MIG devices


def test_vanished_process_series_vanish(tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "comm").write_text("train.py\n")
    (tmp_path / "4242" / "cgroup").write_text(
        "0::/kubepods.slice/kubepods-pod1b2c3d4e_0000_4000_8000_0123456789ab.slice/"
        "cri-containerd-" + "a" * 64 + ".scope\n")
    rig = Rig(gpus=1, proc_root=str(tmp_path), pid=4242)
    rig.step()
    [series] = rig.series("nvml_gpu_process_memory_used_bytes")
    assert series["process"] == "train.py" and series["pid"] == "4242"
    assert series["pod_uid"] == "1b2c3d4e-0000-4000-8000-0123456789ab"
    assert series["container_id"] == "a" * 64
    rig.lib.pid = 4343  # the training process exited; another started
    for _ in range(5):
        rig.step()
    assert [s["pid"] for s in rig.series("nvml_gpu_process_memory_used_bytes")] == ["4343"]


def test_slurm_job_from_cgroup(tmp_path):
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_31337/step_0/user/task_0\n")
    rig = Rig(gpus=1, proc_root=str(tmp_path), pid=77)
    rig.step()
    [series] = rig.series("nvml_gpu_process_memory_used_bytes")
    assert series["slurm_job_id"] == "31337" and series["process"] == ""


def test_processes_collector_off_exports_no_process_series():
    rig = Rig(gpus=1, collectors=[c for c in EVERY_COLLECTOR if c != "processes"])
    rig.step()
    assert rig.series("nvml_gpu_process_memory_used_bytes") == []
    assert rig.lib.calls["nvmlDeviceGetComputeRunningProcesses"] == 0


def test_every_xid_is_counted_including_repeats():
    from stack.processes import wait_until
    rig = Rig(gpus=2, faults=[Fault(gpu=1, xid=79, times=3), Fault(gpu=1, xid=48, times=1)])
    rig.sampler.xid.start()
    try:
        uuid = rig.sampler.devices[1].uuid
        def counted():
            rig.step()
            return (rig.value("nvml_gpu_xid_errors_total", gpu="1", uuid=uuid, xid="79", gpu_instance="") == 3
                    and rig.value("nvml_gpu_xid_errors_total", gpu="1", uuid=uuid, xid="48", gpu_instance="") == 1)
        wait_until(counted, timeout=10, what="XID counts")
        assert gpus_with(rig, "nvml_gpu_xid_errors_total") == {"1"}
    finally:
        rig.sampler.xid.stop()


def test_boundary_remembers_unsupported_and_maps_errors():
    lib = FaultyNVML("healthy", 1)
    nvml = Nvml(lib)
    nvml.init()
    device = Device.open(nvml, 0)
    with pytest.raises(Absent):
        device.call("nvmlDeviceGetNumFans")
    with pytest.raises(Absent):
        device.call("nvmlDeviceGetNumFans")
    assert lib.calls["nvmlDeviceGetNumFans"] == 1
    with pytest.raises(Absent):  # a function this (simulated) binding lacks
        device.call("nvmlDeviceGetBAR1MemoryInfo")
    lib.faults.append(Fault(function="*", gpu=0, error="GpuIsLost"))
    with pytest.raises(GpuLost):
        device.call("nvmlDeviceGetTemperature", H.NVML_TEMPERATURE_GPU)


def test_nvml_text_that_is_not_utf8_is_replaced_never_raised():
    """Driver version, GPU name, UUID and PCI bus id in invalid UTF-8 (pynvml raises on decoding them)."""
    faults = [Fault(function="nvmlSystemGetDriverVersion", answer=b"550.54\xc3"),
              Fault(gpu=1, function="nvmlDeviceGetName", answer=b"NVIDIA \xff\xfe H100"),
              Fault(gpu=0, function="nvmlDeviceGetUUID", answer=b"GPU-\x80bad"),
              Fault(gpu=1, function="nvmlDeviceGetPciInfo_v3", answer=b"00000000:\xc0\xaf:00.0", answer_field="busId")]
    rig = Rig(gpus=2, faults=faults)
    rig.step()
    info = {labels["gpu"]: labels for labels in rig.series("nvml_gpu_info")}
    assert info["1"]["name"] == "NVIDIA \ufffd\ufffd H100" and info["1"]["uuid"] == simulated_uuid(1)
    assert info["1"]["pci_bus_id"] == "00000000:\ufffd\ufffd:00.0"
    assert info["0"]["uuid"] == "GPU-\ufffdbad" and info["0"]["name"] == "NVIDIA H100 80GB HBM3"
    assert rig.series("nvml_driver_info")[0]["driver_version"] == "550.54\ufffd"
    assert rig.series("nvml_exporter_errors_total") == []


def test_gpu_that_cannot_be_opened_at_start_is_skipped_not_fatal():
    rig = Rig(gpus=3, faults=[Fault(gpu=1, function="nvmlDeviceGetUUID", error="GpuIsLost")])
    rig.step()
    assert [d.index for d in rig.sampler.devices] == [0, 2]
    assert gpus_with(rig, "nvml_gpu_info") == {"0", "2"}


def test_pre_hopper_gpu_without_gpm_or_nvlink_exports_neither():
    a100 = DeviceTraits(name="NVIDIA A100-PCIE-40GB", memory_total=40 * 2**30, gpm=False, nvlinks=0, fans=1)
    rig = Rig(gpus=2, devices={1: a100})
    for _ in range(11):
        rig.step()
    assert gpus_with(rig, "nvml_gpu_sm_active_ratio") == {"0"}
    assert gpus_with(rig, "nvml_gpu_nvlink_data_bytes_total") == {"0"}
    assert gpus_with(rig, "nvml_gpu_fan_speed_ratio") == {"1"}
    assert rig.series("nvml_exporter_errors_total") == []


def test_a_scrape_never_calls_nvml():
    rig = Rig(gpus=2, faults=[Fault(function="*", gpu=0, hang=30, at=5)])
    rig.step()
    calls = sum(rig.lib.calls.values())
    rig.clock.advance(10)  # GPU 0 would now hang in any NVML call
    for _ in range(5):
        rig.exposition()
    assert sum(rig.lib.calls.values()) == calls


def test_driver_without_field_batches_still_samples_with_fallbacks():
    rig = Rig(gpus=1, faults=[Fault(function="nvmlDeviceGetFieldValues", error="FunctionNotFound")])
    rig.step()
    rig.step()
    assert gpus_with(rig, "nvml_gpu_power_usage_watts") == {"0"}  # nvmlDeviceGetPowerUsage
    assert gpus_with(rig, "nvml_gpu_memory_used_bytes") == {"0"}
    assert rig.series("nvml_exporter_errors_total") == []


def test_nvlink_reads_the_all_links_aggregate_in_two_fields():
    rig = Rig(gpus=1, collectors=["nvlink"])
    requested: list = []
    batch = rig.lib.nvmlDeviceGetFieldValues
    rig.lib.nvmlDeviceGetFieldValues = lambda handle, fields: requested.extend(fields) or batch(handle, fields)
    for _ in range(3):
        rig.step()
    nvlink = {H.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, H.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX}
    assert {pair for pair in requested if pair[0] in nvlink} == {(field, 0xFFFFFFFF) for field in nvlink}
    # two fields per sample, not two per possible link (the first sample also asks NVLink5's, found absent)
    assert len(requested) == 4 + 2 + 2
    uuid = rig.sampler.devices[0].uuid
    busy = rig.lib.workload.busy_seconds(0, rig.clock() - rig.lib.start)
    assert rig.value("nvml_gpu_nvlink_data_bytes_total", gpu="0", uuid=uuid, direction="tx") == \
        pytest.approx(20e9 * busy, rel=1e-6)


@pytest.mark.parametrize("binding_lacks, faults, call", [
    ((), [], "nvmlDeviceGetTemperatureV"),
    (("nvmlDeviceGetTemperatureV",), [], "nvmlDeviceGetTemperature"),  # nvidia-ml-py before 12.5xx
    ((), [Fault(function="nvmlDeviceGetTemperatureV", error="FunctionNotFound")], "nvmlDeviceGetTemperature"),
])
def test_temperature_comes_from_nvmlDeviceGetTemperatureV_where_present(binding_lacks, faults, call):
    rig = Rig(gpus=1, collectors=["thermal"], binding_lacks=binding_lacks, faults=faults)
    for _ in range(21):  # thermal runs every 10th sample: three runs
        rig.step()
    assert gpus_with(rig, "nvml_gpu_temperature_celsius") == {"0"}
    assert rig.lib.calls[call] == 3
    assert rig.series("nvml_exporter_errors_total") == []


def test_temperature_thresholds_and_memory_temperature_are_exported_thresholds_read_once():
    rig = Rig(gpus=1, collectors=["thermal"])
    for _ in range(5):
        rig.step()
    uuid = rig.sampler.devices[0].uuid
    thresholds = {s["threshold"]: rig.value("nvml_gpu_temperature_threshold_celsius", gpu="0", uuid=uuid, **s)
                  for s in [{"threshold": t} for t in ("slowdown", "shutdown", "gpu_max", "memory_max")]}
    assert thresholds == {"slowdown": 89, "shutdown": 92, "gpu_max": 87, "memory_max": 95}
    assert {s["threshold"] for s in rig.series("nvml_gpu_temperature_threshold_celsius")} == set(thresholds)
    assert 40 <= rig.value("nvml_gpu_memory_temperature_celsius", gpu="0", uuid=uuid) <= 60
    assert rig.lib.calls["nvmlDeviceGetTemperatureThreshold"] == 7  # 4 answered + 3 acoustic NOT_SUPPORTED, once
    assert rig.series("nvml_exporter_errors_total") == []


def test_nvml_up_on_a_host_with_zero_gpus_is_1_and_with_no_gpu_opened_is_0():
    empty = Rig(gpus=0)
    empty.step()
    assert empty.value("nvml_up") == 1
    assert empty.series("nvml_gpu_info") == []
    unopened = Rig(gpus=2, faults=[Fault(function="nvmlDeviceGetUUID", error="GpuIsLost")])
    unopened.step()
    assert unopened.sampler.devices == []
    assert unopened.value("nvml_up") == 0


def test_unknown_from_a_system_level_call_is_a_failed_reading_not_a_lost_gpu():
    # nvmlGpmMetricsGet takes no device handle: nothing can be probed, so nothing is declared lost
    rig = Rig(gpus=1, collectors=["gpm", "memory"], faults=[Fault(function="nvmlGpmMetricsGet", error="Unknown")])
    for _ in range(11):
        rig.step()
    uuid = rig.sampler.devices[0].uuid
    assert rig.value("nvml_gpu_lost", gpu="0", uuid=uuid) == 0
    assert rig.value("nvml_exporter_gpu_lost_total", gpu="0", uuid=uuid) == 0
    assert gpus_with(rig, "nvml_gpu_memory_used_bytes") == {"0"}
    assert rig.value("nvml_exporter_errors_total", collector="gpm", error="unknown") == 2
    # the same for a MIG device's handle read through the system-level path (pod resources)
    nvml = rig.sampler.nvml
    rig.lib.faults.append(Fault(function="nvmlDeviceGetUUID", error="Unknown"))
    with pytest.raises(CallFailed):
        nvml.call("nvmlDeviceGetUUID", rig.sampler.devices[0].handle)


def test_unknown_from_a_mig_device_goes_through_the_parent_gpus_probe():
    rig = Rig(gpus=2, devices={1: DeviceTraits(mig=True)}, collectors=["mig", "memory"])
    real = rig.lib.nvmlDeviceGetMemoryInfo

    def broken_on_mig_devices(handle, version=None):
        if rig.lib._mig_of(handle) is not None:
            raise rig.lib.NVMLError_Unknown()
        return real(handle, version)
    rig.lib.nvmlDeviceGetMemoryInfo = broken_on_mig_devices
    for _ in range(6):
        rig.step()
    uuid = rig.sampler.devices[1].uuid
    assert rig.value("nvml_gpu_lost", gpu="1", uuid=uuid) == 0  # the parent answers its probe
    assert gpus_with(rig, "nvml_gpu_mig_info") == {"1"}
    assert rig.series("nvml_gpu_mig_memory_used_bytes") == []
    assert rig.value("nvml_exporter_errors_total", collector="mig", error="unknown") == 4  # 2 instances x 2 runs


def test_a_lost_gpu_whose_probe_answers_no_permission_comes_back():
    # unprivileged under MIG the parent's memory query answers NO_PERMISSION: it answered, it is alive
    faults = [Fault(gpu=1, function="*", error="GpuIsLost", at=3.0, until=8.0),
              Fault(gpu=1, function="nvmlDeviceGetMemoryInfo", error="NoPermission")]
    rig = Rig(gpus=2, faults=faults, collectors=["thermal"])
    uuid = rig.sampler.devices[1].uuid
    rig.step(4.0)
    assert rig.value("nvml_gpu_lost", gpu="1", uuid=uuid) == 1
    rig.step(5.0)  # t = 9: back
    assert rig.value("nvml_gpu_lost", gpu="1", uuid=uuid) == 0
    assert gpus_with(rig, "nvml_gpu_temperature_celsius") == {"0", "1"}


def test_a_gpu_instance_with_several_compute_instances_is_read_once_per_run():
    # each compute instance is a MIG device of its own: two per GPU instance here
    rig = Rig(gpus=1, devices={0: DeviceTraits(mig=True, compute_instances=2)}, collectors=["mig"])
    for _ in range(11):
        rig.step()
    uuid = rig.sampler.devices[0].uuid
    mig = rig.series("nvml_gpu_mig_info")
    assert sorted(s["gpu_instance"] for s in mig) == ["1", "1", "2", "2"]  # one MIG-UUID per compute instance
    assert len({s["mig_uuid"] for s in mig}) == 4
    for gi in ("1", "2"):
        assert 0.5 < rig.value("nvml_gpu_mig_sm_active_ratio", gpu="0", uuid=uuid, gpu_instance=gi) <= 1
    assert rig.series("nvml_exporter_errors_total") == []  # no GPM window read twice within 100 ms
    assert rig.lib.calls["nvmlGpmMigSampleGet"] == 3 * 2  # three runs, once per GPU instance


def test_mig_device_slots_the_driver_does_not_support_are_no_failure(caplog):
    faults = [Fault(gpu=1, function="nvmlDeviceGetMigDeviceHandleByIndex", error="NotSupported")]
    rig = Rig(gpus=2, devices={1: DeviceTraits(mig=True)}, faults=faults, collectors=["mig", "memory"])
    for _ in range(11):
        rig.step()
    assert rig.series("nvml_gpu_mig_info") == []
    assert rig.series("nvml_exporter_errors_total") == []
    assert rig.value("nvml_exporter_collector_success", collector="mig") == 1
    assert not [r for r in caplog.records if "collector mig failed" in r.getMessage()]


def test_gpm_windows_shorter_than_the_driver_computes_are_not_sampled():
    # 32-bit PCIe counters: the rate comes from GPM at every 10 ms sample; NVML answers INVALID_ARGUMENT
    # for a window under 100 ms, so windows are left open until they are long enough
    rig = Rig(gpus=1, collectors=["pcie"], interval=0.01, devices={0: DeviceTraits(field_types=PCIE_32_BIT)})
    for _ in range(50):
        rig.step()
    uuid = rig.sampler.devices[0].uuid
    assert rig.value("nvml_gpu_pcie_throughput_bytes_per_second", gpu="0", uuid=uuid, direction="tx") == \
        pytest.approx(PCIE_TX_RATE, rel=1e-3)
    assert rig.series("nvml_exporter_errors_total") == []


def fake_proc(root, pid_namespace: str) -> None:
    """A /proc where PID 4242 is a process in a container and /proc/self/ns/pid names `pid_namespace`."""
    (root / "self" / "ns").mkdir(parents=True)
    (root / "self" / "ns" / "pid").symlink_to(pid_namespace)
    (root / "4242").mkdir()
    (root / "4242" / "comm").write_text("nginx\n")
    (root / "4242" / "cgroup").write_text("0::/system.slice/docker-" + "b" * 64 + ".scope\n")


def test_outside_the_host_pid_namespace_the_pids_nvml_answers_are_ours_and_named(tmp_path, caplog):
    """NVML translates its PIDs into the caller's PID namespace: outside the host's, the processes it
    lists are in our /proc (the others are left out), so they get their names and attribution."""
    fake_proc(tmp_path, "pid:[4026532201]")  # a container's own PID namespace
    rig = Rig(gpus=2, proc_root=str(tmp_path), pid=4242, collectors=["processes"])
    for _ in range(6):
        rig.step()
    series = rig.series("nvml_gpu_process_memory_used_bytes")
    assert [s["pid"] for s in series] == ["4242", "4242"]
    assert all(s["process"] == "nginx" and s["container_id"] == "b" * 64 for s in series)
    assert rig.value("nvml_exporter_host_pid_namespace") == 0
    assert len([r for r in caplog.records if "host PID namespace" in r.getMessage()]) == 1


def test_in_the_host_pid_namespace_gpu_processes_are_named(tmp_path):
    fake_proc(tmp_path, "pid:[4026531836]")  # the initial PID namespace (PROC_PID_INIT_INO)
    rig = Rig(gpus=1, proc_root=str(tmp_path), pid=4242, collectors=["processes"])
    rig.step()
    [series] = rig.series("nvml_gpu_process_memory_used_bytes")
    assert series["process"] == "nginx" and series["container_id"] == "b" * 64
    assert rig.value("nvml_exporter_host_pid_namespace") == 1


@pytest.mark.parametrize("scenario", ["healthy", "co-tenant"])
def test_every_series_a_collector_emits_is_declared_with_its_labels(tmp_path, scenario):
    """SampleContext.emit does not check names on the hot path: an undeclared metric (or a wrong label
    count) would silently never be served. MIG GPUs and a process with a /proc entry included."""
    from exporter.metrics import SPECS
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "comm").write_text("python\n")
    rig = Rig(scenario, gpus=2, devices={1: DeviceTraits(mig=True)}, proc_root=str(tmp_path), pid=4242)
    emitted: dict[str, set[int]] = {}
    for _ in range(12):
        rig.step(40.0 if scenario == "co-tenant" else None)
        for sample in rig.sampler.store.current.samples:
            for metric, series in sample.values.items():
                emitted.setdefault(metric, set()).update(len(labels) for labels in series)
    assert "nvml_gpu_process_memory_used_bytes" in emitted and "nvml_gpu_energy_joules_total" in emitted
    assert {metric: arities for metric, arities in emitted.items()
            if metric not in SPECS or arities != {len(SPECS[metric].labels)}} == {}


def test_readings_that_did_not_change_are_handed_back_as_the_same_series_and_keep_their_lines():
    # the thermal-throttle scenario starts throttling 30 s in: the reasons change once, then hold
    rig = Rig("thermal-throttle", gpus=1, collectors=["throttle", "ecc"])
    unchanged = ("nvml_gpu_info", "nvml_gpu_throttle_active", "nvml_gpu_throttle_seconds_total",
                 "nvml_gpu_ecc_errors_total", "nvml_gpu_remapped_rows_total")
    rig.step()
    before = rig.sampler.store.current.samples[0]
    rig.step()
    after = rig.sampler.store.current.samples[0]
    assert all(after.values[metric] is before.values[metric] for metric in unchanged)
    assert all(after.lines[i] is before.lines[i] for i in range(len(after.lines)) if before.lines[i])
    for _ in range(30):
        rig.step()
    throttled = rig.sampler.store.current.samples[0].values
    assert throttled["nvml_gpu_throttle_active"][("sw_thermal_slowdown",)] == 1.0
    assert throttled["nvml_gpu_throttle_active"] is not after.values["nvml_gpu_throttle_active"]
    rig.step()
    later = rig.sampler.store.current.samples[0].values
    assert later["nvml_gpu_throttle_active"] is throttled["nvml_gpu_throttle_active"]
    # an active reason's seconds grow at every sample: made again, not handed back
    assert later["nvml_gpu_throttle_seconds_total"][("sw_thermal_slowdown",)] == pytest.approx(
        throttled["nvml_gpu_throttle_seconds_total"][("sw_thermal_slowdown",)] + 1.0)
