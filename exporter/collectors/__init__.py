"""The collectors, one module per NVML concern, in the order they run within a sample."""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext
from exporter.collectors.clocks import ClocksCollector
from exporter.collectors.ecc import EccCollector
from exporter.collectors.gpm import GpmCollector
from exporter.collectors.memory import MemoryCollector
from exporter.collectors.mig import MigCollector
from exporter.collectors.nvlink import NvlinkCollector
from exporter.collectors.pcie import PcieCollector
from exporter.collectors.podresources import PodResourcesCollector
from exporter.collectors.power import PerformanceStateCollector, PowerCollector
from exporter.collectors.processes import ProcessesCollector
from exporter.collectors.thermal import FanCollector, ThermalCollector
from exporter.collectors.throttle import ThrottleCollector
from exporter.collectors.utilization import UtilizationCollector
from exporter.collectors.xid import XidCollector, XidCounts, XidWatcher

ALL: tuple[type[Collector], ...] = (
    UtilizationCollector, MemoryCollector, ThermalCollector, PowerCollector, ThrottleCollector,
    PcieCollector, NvlinkCollector, EccCollector, XidCollector,
    ClocksCollector, PerformanceStateCollector, FanCollector, ProcessesCollector, GpmCollector, MigCollector,
    PodResourcesCollector,
)
BY_NAME: dict[str, type[Collector]] = {collector.name: collector for collector in ALL}

__all__ = ["ALL", "BY_NAME", "Collector", "SampleContext", "XidCounts", "XidWatcher"]
