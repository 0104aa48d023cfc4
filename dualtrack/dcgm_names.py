"""dcgm-exporter's names for what the exporter measures, printed as rules/dcgm/dcgm.yml.

    python -m dualtrack.dcgm_names > rules/dcgm/dcgm.yml

Tools written for NVIDIA's dcgm-exporter (its Grafana dashboard 12239, KEDA's GPU scalers, GPU cost
tools) query DCGM's names in DCGM's units with DCGM's labels. Each recording rule here gives one of
them from the exporter's series: the `DCGM_FI_DEV_*` fields of dcgm-exporter's default counters file
(etc/default-counters.csv in NVIDIA/dcgm-exporter) and the `DCGM_FI_PROF_*` ratios from GPM.
`NO_EQUIVALENT` lists the default fields the exporter does not measure (docs/metrics.md shows both).
"""
from __future__ import annotations

import sys
from typing import NamedTuple

import yaml

from . import prometheus

#: dcgm-exporter's labels of a GPU, copied onto every DCGM series (the exporter's own labels stay).
GPU_LABELS = ("UUID", "device", "modelName", "pci_bus_id", "Hostname", "DCGM_FI_DRIVER_VERSION")
POD_LABELS = ("pod", "namespace", "container")
GPU_INFO = "instance_gpu:dcgm_labels:info"
INSTANCE_INFO = "instance_gpu_instance:dcgm_labels:info"
MIB = 2 ** 20


class Name(NamedTuple):
    """One DCGM series: its name, the exporter's expression in DCGM's unit, and what it is."""

    dcgm: str
    expr: str
    meaning: str
    mig: str | None = None  # the same of each MIG GPU instance (label GPU_I_ID), from nvml_gpu_mig_*


NAMES: tuple[Name, ...] = (
    Name("DCGM_FI_DEV_SM_CLOCK", 'nvml_gpu_clock_hertz{clock="sm"} / 1e6', "SM clock (MHz)"),
    Name("DCGM_FI_DEV_MEM_CLOCK", 'nvml_gpu_clock_hertz{clock="memory"} / 1e6', "memory clock (MHz)"),
    Name("DCGM_FI_DEV_MEMORY_TEMP", "nvml_gpu_memory_temperature_celsius", "memory temperature (C)"),
    Name("DCGM_FI_DEV_GPU_TEMP", "nvml_gpu_temperature_celsius", "GPU temperature (C)"),
    Name("DCGM_FI_DEV_POWER_USAGE", "nvml_gpu_power_usage_watts", "power draw (W)"),
    Name("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "nvml_gpu_energy_joules_total * 1000",
         "energy since the driver loaded (mJ; DCGM: since boot)"),
    Name("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "nvml_gpu_pcie_replay_errors_total", "PCIe retries"),
    Name("DCGM_FI_DEV_GPU_UTIL", "nvml_gpu_utilization_ratio * 100", "GPU utilization (%)"),
    Name("DCGM_FI_DEV_MEM_COPY_UTIL", "nvml_gpu_memory_controller_utilization_ratio * 100",
         "memory controller utilization (%)"),
    Name("DCGM_FI_DEV_FB_FREE", f"nvml_gpu_memory_free_bytes / {MIB}", "framebuffer free (MiB)",
         f"clamp_min(nvml_gpu_mig_memory_total_bytes - nvml_gpu_mig_memory_used_bytes, 0) / {MIB}"),
    Name("DCGM_FI_DEV_FB_USED", f"nvml_gpu_memory_used_bytes / {MIB}", "framebuffer used (MiB)",
         f"nvml_gpu_mig_memory_used_bytes / {MIB}"),
    Name("DCGM_FI_DEV_FB_RESERVED",
         f"clamp_min(nvml_gpu_memory_total_bytes - nvml_gpu_memory_used_bytes - nvml_gpu_memory_free_bytes, 0)"
         f" / {MIB}", "framebuffer reserved by the driver (MiB): total - used - free"),
    Name("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 'nvml_gpu_remapped_rows_total{severity="uncorrectable"}',
         "rows remapped for uncorrectable errors"),
    Name("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", 'nvml_gpu_remapped_rows_total{severity="correctable"}',
         "rows remapped for correctable errors"),
    Name("DCGM_FI_DEV_ROW_REMAP_FAILURE", "nvml_gpu_remapped_rows_failure", "1 if a row remapping failed"),
    Name("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "nvml_gpu_utilization_ratio",
         "share of time the graphics/compute engine was busy (NVML's utilization, 0..1)",
         "nvml_gpu_mig_utilization_ratio"),
    Name("DCGM_FI_PROF_SM_ACTIVE", "nvml_gpu_sm_active_ratio", "SM activity from GPM (0..1)",
         "nvml_gpu_mig_sm_active_ratio"),
    Name("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "nvml_gpu_tensor_active_ratio", "tensor pipe activity from GPM (0..1)",
         "nvml_gpu_mig_tensor_active_ratio"),
    Name("DCGM_FI_PROF_DRAM_ACTIVE", "nvml_gpu_dram_active_ratio", "DRAM activity from GPM (0..1)",
         "nvml_gpu_mig_dram_active_ratio"),
    Name("DCGM_FI_PROF_PCIE_TX_BYTES", 'nvml_gpu_pcie_throughput_bytes_per_second{direction="tx"}',
         "PCIe transmit rate (bytes/s)"),
    Name("DCGM_FI_PROF_PCIE_RX_BYTES", 'nvml_gpu_pcie_throughput_bytes_per_second{direction="rx"}',
         "PCIe receive rate (bytes/s)"),
)

#: dcgm-exporter's default fields the exporter does not measure, and what comes closest.
NO_EQUIVALENT: dict[str, str] = {
    "DCGM_FI_DEV_ENC_UTIL": "not read (encoder utilization)",
    "DCGM_FI_DEV_DEC_UTIL": "not read (decoder utilization)",
    "DCGM_FI_DEV_XID_ERRORS": "the last XID's number as a value; the exporter counts every XID by number "
                              "instead: `nvml_gpu_xid_errors_total{xid}`",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "DCGM's own counter units; the exporter counts bytes: "
                                          "`nvml_gpu_nvlink_data_bytes_total{direction}`",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": "not read (vGPU licensing)",
    "GPU_I_PROFILE": "label: the exporter does not read MIG profile names (GPU_I_ID is set)",
}


def _identity() -> str:
    """nvml_gpu_info with dcgm-exporter's label names (value 1)."""
    expr = "max by (job, instance, gpu, uuid, name, pci_bus_id) (nvml_gpu_info)"
    for target, replacement, source, regex in (("UUID", "$1", "uuid", "(.*)"), ("modelName", "$1", "name", "(.*)"),
                                                ("device", "nvidia$1", "gpu", "(.*)"),
                                                ("Hostname", "$1", "instance", "(.*?)(?::[0-9]+)?")):
        expr = f'label_replace({expr}, "{target}", "{replacement}", "{source}", "{regex}")'
    return expr


def _info_rules() -> list[tuple[str, str]]:
    """(record, expr) of the label series every DCGM rule joins, in evaluation order."""
    copied = ", ".join(GPU_LABELS)
    pods = ", ".join(POD_LABELS)
    mig = ('label_replace(max by (job, instance, gpu, uuid, gpu_instance) (nvml_gpu_mig_info), '
           '"GPU_I_ID", "$1", "gpu_instance", "(.*)")')
    mig_labels = f"{mig} * on (job, instance, gpu, uuid) group_left ({copied}) instance_gpu:dcgm_driver:info"
    return [
        ("instance_gpu:dcgm_identity:info", _identity()),
        ("instance_gpu:dcgm_driver:info",
         "instance_gpu:dcgm_identity:info * on (job, instance) group_left (DCGM_FI_DRIVER_VERSION) "
         'label_replace(topk by (job, instance) (1, nvml_driver_info), "DCGM_FI_DRIVER_VERSION", "$1", '
         '"driver_version", "(.*)") or on (job, instance, uuid) instance_gpu:dcgm_identity:info'),
        (GPU_INFO,
         f"instance_gpu:dcgm_driver:info * on (job, instance, uuid) group_left ({pods}) "
         f'topk by (job, instance, uuid) (1, nvml_gpu_pod_info{{gpu_instance=""}}) '
         f"or on (job, instance, uuid) instance_gpu:dcgm_driver:info"),
        (INSTANCE_INFO,
         f"({mig_labels}) * on (job, instance, uuid, gpu_instance) group_left ({pods}) "
         f'topk by (job, instance, uuid, gpu_instance) (1, nvml_gpu_pod_info{{gpu_instance!=""}}) '
         f"or on (job, instance, uuid, gpu_instance) ({mig_labels})"),
    ]


def expression(name: Name) -> str:
    """The rule's PromQL: the exporter's series in DCGM's unit, with DCGM's labels joined; with a MIG
    source, its GPU instances' series too (they differ by gpu_instance and GPU_I_ID)."""
    labels = ", ".join(GPU_LABELS + POD_LABELS)
    expr = f"({name.expr}) * on (job, instance, gpu, uuid) group_left ({labels}) {GPU_INFO}"
    if name.mig is None:
        return expr
    return (f"{expr} or ({name.mig}) * on (job, instance, gpu, uuid, gpu_instance) group_left (GPU_I_ID, {labels}) "
            f"{INSTANCE_INFO}")


def render() -> str:
    """rules/dcgm/dcgm.yml."""
    rules = [{"record": record, "expr": prometheus.exporter_only(expr)}
             for record, expr in _info_rules() + [(name.dcgm, expression(name)) for name in NAMES]]
    body = yaml.safe_dump({"groups": [{"name": "dualtrack-dcgm-names.rules", "rules": rules}]},
                          sort_keys=False, width=90)
    return HEADER + body


HEADER = """\
# Generated by `python -m dualtrack.dcgm_names > rules/dcgm/dcgm.yml` from dualtrack/dcgm_names.py:
# do not edit.
# dcgm-exporter's names, units and labels for what the exporter measures (docs/metrics.md,
# "dcgm-exporter's names"). On by default; to turn it off, delete the rules/dcgm line of rule_files in
# prometheus.yml (compose and the no-Docker stack), or prometheusrule-dcgm.yaml from
# deploy/kubernetes/kustomization.yaml.
"""


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
