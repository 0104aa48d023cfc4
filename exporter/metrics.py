"""Every metric the exporter serves, declared once: name, type, help and label names.

Per-GPU metrics carry the labels `gpu` and `uuid` first; `labels` lists the extra ones. Help texts
say the values are sampled: they come from the sampler's latest snapshot, not from a scrape-time
NVML call.
"""
from __future__ import annotations

from dataclasses import dataclass

GAUGE = "gauge"
COUNTER = "counter"
GPU_LABELS = ("gpu", "uuid")
#: a GPU process: its host PID, name and workload, and its PID namespace with its PID there
PROCESS_LABELS = ("pid", "process", "container_id", "pod_uid", "slurm_job_id", "pid_namespace", "namespace_pid",
                  "start_time")


@dataclass(frozen=True)
class MetricSpec:
    """One family the exporter serves. `name` is the name its samples carry (a counter's ends in `_total`),
    as the collectors emit it and the exporter's own text writer (exporter.textformat) prints it.

    Not trainer_hook.contract.Series: the exporter imports no other package (tests/repo/test_layering.py), and
    a Series names its family the way prometheus_client builds one (after `training_`, a counter without
    `_total`) for the hook, which pushes through prometheus_client."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...] = ()


def _g(name: str, help_: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, GAUGE, help_ + " Sampled.", labels)


def _c(name: str, help_: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, COUNTER, help_ + " Sampled.", labels)


GPU_METRICS: tuple[MetricSpec, ...] = (
    _g("nvml_gpu_info", "GPU identity, value 1.", "name", "pci_bus_id", "mig_mode", "simulated"),
    _g("nvml_gpu_utilization_ratio", "Fraction of the last sample period a kernel ran (nvidia-smi utilization.gpu)."),
    _g("nvml_gpu_memory_controller_utilization_ratio",
       "Fraction of the last sample period device memory was read or written (utilization.memory)."),
    _c("nvml_gpu_busy_seconds_total",
       "Time integral of GPU utilization from the driver's sample buffer, in seconds."),
    _c("nvml_gpu_idle_seconds_total", "Seconds with utilization below the idle threshold."),
    _g("nvml_gpu_memory_used_bytes", "Device memory used, in bytes."),
    _g("nvml_gpu_memory_total_bytes", "Device memory total, in bytes."),
    _g("nvml_gpu_memory_free_bytes", "Device memory free, in bytes."),
    _g("nvml_gpu_temperature_celsius", "GPU core temperature, in degrees Celsius."),
    _g("nvml_gpu_memory_temperature_celsius", "Memory (HBM) temperature, in degrees Celsius."),
    _g("nvml_gpu_temperature_threshold_celsius",
       "Temperature threshold (slowdown, shutdown, gpu_max, memory_max, acoustic_*), in degrees Celsius.",
       "threshold"),
    _g("nvml_gpu_fan_speed_ratio", "Fan speed as a fraction of its maximum.", "fan"),
    _g("nvml_gpu_power_usage_watts",
       "Board power draw, in watts: the mean over the sample period, from the energy counter (as nvidia-smi's "
       "power.draw); the instantaneous reading where there is no energy counter."),
    _g("nvml_gpu_power_instant_watts",
       "Board power draw, in watts: instantaneous (field POWER_INSTANT); where only nvmlDeviceGetPowerUsage "
       "answers, a 1 s average on Ampere (except A100) and newer."),
    _g("nvml_gpu_power_limit_watts", "Enforced power limit, in watts."),
    _c("nvml_gpu_energy_joules_total", "Energy consumed since the driver was loaded, in joules."),
    _g("nvml_gpu_performance_state", "Performance state P0 (max) to P15 (min), as a number."),
    _g("nvml_gpu_clock_hertz", "Current clock, in hertz.", "clock"),
    _g("nvml_gpu_clock_max_hertz", "Maximum clock, in hertz.", "clock"),
    _g("nvml_gpu_throttle_active", "1 while this clocks-event (throttle) reason is active, else 0.", "reason"),
    _c("nvml_gpu_throttle_seconds_total", "Seconds this clocks-event (throttle) reason was active.", "reason"),
    _g("nvml_gpu_pcie_throughput_bytes_per_second", "PCIe throughput over the last sample period, in bytes per second.",
       "direction"),
    _c("nvml_gpu_pcie_replay_errors_total", "PCIe replay (retransmission) counter."),
    _c("nvml_gpu_nvlink_data_bytes_total", "NVLink payload bytes over all links.", "direction"),
    _c("nvml_gpu_ecc_errors_total", "ECC errors since the driver was loaded (volatile).", "error"),
    _c("nvml_gpu_retired_pages_total", "Pages retired by dynamic page retirement.", "cause"),
    _g("nvml_gpu_retired_pages_pending", "1 if pages are pending retirement (reset needed), else 0."),
    _c("nvml_gpu_remapped_rows_total", "Memory rows remapped.", "severity"),
    _g("nvml_gpu_remapped_rows_pending", "1 if a row remapping is pending (reset needed), else 0."),
    _g("nvml_gpu_remapped_rows_failure", "1 if a row remapping failed, else 0."),
    _c("nvml_gpu_xid_errors_total", "XID errors reported by the driver, every occurrence counted: xid is the "
       "code for the catalogued codes (docs/metrics.md), \"other\" for the rest; gpu_instance the MIG GPU "
       "instance of a kernel-log XID, empty for the whole GPU.", "xid", "gpu_instance"),
    _g("nvml_gpu_process_memory_used_bytes", "Device memory used by a compute process, in bytes.", *PROCESS_LABELS),
    _g("nvml_gpu_process_sm_utilization_ratio",
       "SM utilization of a compute process (nvidia-smi pmon sm), the mean of the driver's samples since the "
       "last read; 0 with none (idle).", *PROCESS_LABELS),
    _g("nvml_gpu_sm_active_ratio", "Fraction of SMs busy over the last GPM window (Hopper+)."),
    _g("nvml_gpu_tensor_active_ratio", "Fraction of time tensor cores were active over the last GPM window (Hopper+)."),
    _g("nvml_gpu_dram_active_ratio", "Fraction of DRAM bandwidth used over the last GPM window (Hopper+)."),
    _g("nvml_gpu_pod_info", "Kubernetes pod, namespace and container holding the GPU (or its MIG device "
       "gpu_instance, mig_uuid), from the kubelet pod-resources API, value 1.",
       "pod", "namespace", "container", "gpu_instance", "mig_uuid"),
    _g("nvml_gpu_mig_info", "MIG GPU instance identity, value 1.", "gpu_instance", "mig_uuid"),
    _g("nvml_gpu_mig_memory_used_bytes", "Device memory used in a MIG GPU instance, in bytes.", "gpu_instance"),
    _g("nvml_gpu_mig_memory_total_bytes", "Device memory of a MIG GPU instance, in bytes.", "gpu_instance"),
    _g("nvml_gpu_mig_utilization_ratio", "Fraction of the last sample period a kernel ran in a MIG GPU instance.",
       "gpu_instance"),
    _g("nvml_gpu_mig_sm_active_ratio", "Fraction of a MIG GPU instance's SMs busy over the last GPM window.",
       "gpu_instance"),
    _g("nvml_gpu_mig_tensor_active_ratio",
       "Fraction of time a MIG GPU instance's tensor cores were active over the last GPM window.", "gpu_instance"),
    _g("nvml_gpu_mig_dram_active_ratio",
       "Fraction of DRAM bandwidth a MIG GPU instance used over the last GPM window.", "gpu_instance"),
)

SPECS: dict[str, MetricSpec] = {spec.name: spec for spec in GPU_METRICS}

# Families emitted by the scrape collector itself (not per-GPU samples).
UP = MetricSpec("nvml_up", GAUGE, "1 if NVML answered for at least one GPU in the latest snapshot, or reports "
                "no GPU at all, else 0.")
DRIVER_INFO = MetricSpec("nvml_driver_info", GAUGE, "NVIDIA driver identity, value 1.",
                         ("driver_version", "cuda_driver_version"))
BUILD_INFO = MetricSpec("nvml_exporter_build_info", GAUGE, "Exporter build, value 1.",
                        ("version", "python_version", "pynvml_version"))
GPU_LOST = MetricSpec("nvml_gpu_lost", GAUGE, "1 while a GPU seen earlier is unreachable, else 0.", GPU_LABELS)
GPU_LOST_TOTAL = MetricSpec("nvml_exporter_gpu_lost_total", COUNTER, "Times a GPU became unreachable.",
                            GPU_LABELS)
COLLECTOR_SUCCESS = MetricSpec("nvml_exporter_collector_success", GAUGE,
                               "1 if the collector's last run succeeded on every GPU, else 0.", ("collector",))
COLLECTOR_DURATION = MetricSpec("nvml_exporter_collector_duration_seconds", GAUGE,
                                "Seconds the collector's last run took, summed over GPUs.", ("collector",))
ERRORS = MetricSpec("nvml_exporter_errors_total", COUNTER,
                    "NVML errors by collector and NVML error name (unsupported fields are not errors).",
                    ("collector", "error"))
SNAPSHOT_AGE = MetricSpec("nvml_exporter_snapshot_age_seconds", GAUGE,
                          "Age of the oldest GPU sample in the served snapshot, in seconds.")
GPU_SAMPLE_AGE = MetricSpec("nvml_exporter_gpu_sample_age_seconds", GAUGE,
                            "Age of this GPU's latest sample, in seconds.", GPU_LABELS)
HOST_PID_NAMESPACE = MetricSpec("nvml_exporter_host_pid_namespace", GAUGE,
                                "1 if the exporter runs in the host PID namespace, so it sees every GPU process; "
                                "0 if not: only those of its own PID namespace.")
NVML_CALLS = MetricSpec("nvml_exporter_nvml_calls_total", COUNTER,
                        "NVML calls made by the sampler (field batches count once).")

# The exporter process's own series, as prometheus_client's ProcessCollector and PlatformCollector name them.
PROCESS_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("process_virtual_memory_bytes", GAUGE, "Virtual memory size in bytes."),
    MetricSpec("process_resident_memory_bytes", GAUGE, "Resident memory size in bytes."),
    MetricSpec("process_start_time_seconds", GAUGE, "Start time of the process since unix epoch in seconds."),
    MetricSpec("process_cpu_seconds_total", COUNTER, "Total user and system CPU time spent in seconds."),
    MetricSpec("process_open_fds", GAUGE, "Number of open file descriptors."),
    MetricSpec("process_max_fds", GAUGE, "Maximum number of open file descriptors."),
)
PYTHON_INFO = MetricSpec("python_info", GAUGE, "Python platform information",
                         ("implementation", "major", "minor", "patchlevel", "version"))
