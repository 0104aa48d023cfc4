"""dcgm-exporter's names (rules/dcgm/dcgm.yml): NVIDIA's published Grafana dashboard answered by the
simulated exporter scraped by a real Prometheus with the shipped configuration and rules, in DCGM's
units and with DCGM's labels; the rule file as generated and turned on everywhere we ship Prometheus."""
from __future__ import annotations

import re

import yaml

from dualtrack import dcgm_names
from tests.support import daemons
from tests.support.hook import live_stack
from tests.support.paths import REPO

# NVIDIA's dcgm-exporter dashboard (grafana.com 12239): its template variables' and panels' queries,
# as facts about what GPU tooling asks. Source: github.com/NVIDIA/dcgm-exporter,
# grafana/dcgm-exporter-dashboard.json, commit d5e5f510a1b6b393f39a43293ccd9dc985defc79 (Apache-2.0).
DASHBOARD_VARIABLES = {
    "instance": "label_values(DCGM_FI_DEV_GPU_TEMP, instance)",
    "gpu": "label_values(DCGM_FI_DEV_GPU_TEMP, gpu)",
}
DASHBOARD_QUERIES = {
    "GPU Temperature": 'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Avg. Temp": 'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})',
    "GPU Power Usage": 'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Power Total": 'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})',
    "GPU SM Clocks": 'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000',
    "GPU Utilization": 'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Framebuffer Mem Used": 'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}',
    "Tensor Core Utilization": 'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}',
}
#: dcgm-exporter's labels on every GPU series (MIG instances add GPU_I_ID; pods, pod/namespace/container).
DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "pci_bus_id", "Hostname", "DCGM_FI_DRIVER_VERSION"}


def label_values(prometheus_url: str, query: str) -> list[str]:
    """Grafana's label_values(METRIC, LABEL) for a Prometheus datasource."""
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", query).groups()
    return sorted({series["metric"][label] for series in daemons.query(prometheus_url, metric)})


def test_nvidias_dashboard_queries_are_answered_in_dcgm_units_and_labels(tmp_path, start_service) -> None:
    """Every variable and panel query of dashboard 12239, its variables at "All" as Grafana sends
    them, returns data; the values are the exporter's in DCGM's units."""
    _, _, prometheus = live_stack(tmp_path, start_service, "--simulate=healthy", "--simulate.gpus=2")
    daemons.wait_for_series(prometheus.url, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 60,
                            predicate=lambda found: len(found) == 2)
    values = {name: label_values(prometheus.url, query) for name, query in DASHBOARD_VARIABLES.items()}
    assert values["gpu"] == ["0", "1"] and len(values["instance"]) == 1
    for title, query in DASHBOARD_QUERIES.items():
        for name, found in values.items():  # "All" of a multi-value variable, as Grafana writes it: (a|b)
            escaped = (re.escape(value).replace("\\", "\\\\") for value in found)  # in a PromQL string
            query = query.replace(f"${name}", "(" + "|".join(escaped) + ")")
        assert daemons.query(prometheus.url, query), f"{title}: {query} returned nothing"
    [temperature, *_] = daemons.query(prometheus.url, 'DCGM_FI_DEV_GPU_TEMP{gpu="0"}')
    assert DCGM_LABELS <= set(temperature["metric"]), temperature["metric"]
    assert temperature["metric"]["device"] == "nvidia0" and temperature["metric"]["UUID"].startswith("GPU-")
    # DCGM's units: each recorded value is the exporter's, converted, at the time of its evaluation
    # (MiB, MHz; percent for *_UTIL against the same source as the 0..1 DCGM_FI_PROF_GR_ENGINE_ACTIVE).
    units = {"DCGM_FI_DEV_FB_USED": "nvml_gpu_memory_used_bytes / 1048576",
             "DCGM_FI_DEV_SM_CLOCK": 'nvml_gpu_clock_hertz{clock="sm"} / 1e6',
             "DCGM_FI_DEV_GPU_UTIL": "DCGM_FI_PROF_GR_ENGINE_ACTIVE * 100"}
    for dcgm, ours in units.items():
        [evaluated] = daemons.query(prometheus.url, f'timestamp({dcgm}{{gpu="1"}})')
        at = float(evaluated["value"][1])
        [found] = daemons.query(prometheus.url, f'{dcgm}{{gpu="1"}} - on (job, instance, gpu, uuid) ({ours})', at=at)
        assert abs(float(found["value"][1])) < 1e-6, (dcgm, found)

def test_every_mapped_name_is_recorded_from_the_simulated_gpus(tmp_path, start_service) -> None:
    """Each DCGM name the rules give (outside MIG) has a series for each simulated GPU."""
    _, _, prometheus = live_stack(tmp_path, start_service, "--simulate=healthy", "--simulate.gpus=1")
    names = sorted({name.dcgm for name in dcgm_names.NAMES})
    daemons.wait_for_series(prometheus.url, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 60)
    missing = [name for name in names if not daemons.query(prometheus.url, name)]
    assert missing == []


def test_the_rule_file_is_generated_and_loaded_wherever_prometheus_is_shipped() -> None:
    """rules/dcgm/dcgm.yml is what dualtrack/dcgm_names.py prints; prometheus.yml (compose and the
    no-Docker stack) loads it, and so does the Kubernetes kustomization; docs/metrics.md maps each name."""
    assert (REPO / "rules" / "dcgm" / "dcgm.yml").read_text() == dcgm_names.render()
    config = yaml.safe_load((REPO / "prometheus.yml").read_text())
    assert "/etc/prometheus/rules/dcgm/*.yml" in config["rule_files"]
    kustomization = yaml.safe_load((REPO / "deploy" / "kubernetes" / "kustomization.yaml").read_text())
    assert "prometheusrule-dcgm.yaml" in kustomization["resources"]
    metrics_doc = (REPO / "docs" / "metrics.md").read_text()
    for name in {name.dcgm for name in dcgm_names.NAMES} | set(dcgm_names.NO_EQUIVALENT):
        assert f"`{name}`" in metrics_doc, name
