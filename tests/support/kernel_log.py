"""Driver XID lines as the kernel log holds them, and the XIDs an exporter daemon serves."""
from __future__ import annotations

from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from stack import processes

# the simulated GPUs' bus ids (exporter.simulated.identity._BUS_IDS), as the kernel writes them
KERNEL_BUS = {0: "0000:18:00", 1: "0000:2a:00"}


def xid_line(gpu: int, code: int, kmsg: bool = False) -> str:
    """A driver XID line as `dmesg --raw` shows it, or as a /dev/kmsg record (facility 0, level 4)."""
    text = f"NVRM: Xid (PCI:{KERNEL_BUS[gpu]}): {code}, pid='<unknown>', name=<unknown>, see the catalog"
    return f"4,1021,{5_000_000 + code},-;{text}\n" if kmsg else f"<4>[ 5.{code:06d}] {text}\n"


def append(path: Path, *lines: str) -> None:
    with open(path, "a") as handle:
        handle.write("".join(lines))


def scrape_xids(service: processes.Service) -> dict[tuple[str, str], float]:
    text = requests.get(service.url + "/metrics", timeout=5).text
    return {(s.labels["gpu"], s.labels["xid"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "nvml_gpu_xid_errors_total"}
