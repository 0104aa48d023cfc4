"""Helpers for the exporter tests: a fake clock and a sampler over simulated NVML at the pynvml boundary."""
from __future__ import annotations

import re
from pathlib import Path

import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.collectors import ALL
from exporter.exposition import GpuSnapshotCollector
from exporter.nvml import Nvml
from exporter.sampler import Sampler
from exporter.simulated import DeviceTraits
from stack import processes
from tests.support.nvml_faults import Fault, FaultyNVML
from tests.support.paths import TESTS

GOLDEN = TESTS / "exporter" / "golden"
EVERY_COLLECTOR = [c.name for c in ALL if c.default_enabled]


class FakeClock:
    """A clock tests advance by hand (seconds, starting at an arbitrary epoch-like value)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Rig:
    """Simulated NVML + Sampler + scrape collector, driven sample by sample with a fake clock."""

    def __init__(self, scenario: str = "healthy", gpus: int = 2, *, devices: dict[int, DeviceTraits] | None = None,
                 faults: list[Fault] | None = None, collectors: list[str] | None = None, interval: float = 1.0,
                 proc_root: str = "/proc", pid: int | None = None, binding_lacks: tuple[str, ...] = (),
                 xid_kernel_log: str = "", driver_lacks: tuple[str, ...] = ()) -> None:
        self.clock = FakeClock()
        self.lib = FaultyNVML(scenario, gpus, devices=devices, faults=faults, clock=self.clock, pid=pid,
                              binding_lacks=binding_lacks, driver_lacks=driver_lacks)
        self.nvml = Nvml(self.lib)
        self.nvml.init()
        self.sampler = Sampler(self.nvml, collectors or EVERY_COLLECTOR, interval=interval, simulated=True,
                               proc_root=proc_root, clock=self.clock, xid_kernel_log=xid_kernel_log)
        self.registry = CollectorRegistry()
        self.registry.register(GpuSnapshotCollector(self.sampler, clock=self.clock))

    def step(self, seconds: float | None = None) -> None:
        """Advance the clock by one interval (or `seconds`) and sample every GPU once."""
        self.clock.advance(self.sampler.interval if seconds is None else seconds)
        for gpu in self.sampler.gpus:
            gpu.sample_once()

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()

    def series(self, name: str) -> list[dict[str, str]]:
        """Label sets of every sample named `name` in the exposition."""
        return [sample.labels for family in text_string_to_metric_families(self.exposition())
                for sample in family.samples if sample.name == name]


def faulty_exporter(workdir: Path, args: list[str], **kwargs) -> processes.Service:
    """`processes.exporter(...)` run as `python -m tests.support.faulty_exporter`: the same daemon, and
    `--faults=FILE` applies a fault plan (tests/support/nvml_faults.py) to its simulated NVML."""
    service = processes.exporter(workdir, args, **kwargs)
    service.argv[service.argv.index("exporter")] = "tests.support.faulty_exporter"
    return service


def scraped(url: str) -> dict[str, list]:
    """A daemon's /metrics samples by sample name (a counter's with `_total`, which its family name lacks)."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def gpus_with(rig: Rig, name: str) -> set[str]:
    return {labels["gpu"] for labels in rig.series(name)}


def normalise(exposition: str) -> str:
    """Names, label sets and types only: values and volatile label values (uuid, pid) masked."""
    lines = []
    for line in exposition.splitlines():
        if line.startswith("#"):
            lines.append(line)
            continue
        series = line.rsplit(" ", 1)[0]
        series = re.sub(r'\b(pid|process|container_id|pod_uid|slurm_job_id|pid_namespace|namespace_pid|start_time|uuid|'
                        r'python_version|pynvml_version|version)="[^"]*"', r'\1="*"', series)
        lines.append(series)
    return "\n".join(lines) + "\n"
