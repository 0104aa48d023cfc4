"""Simulated NVML: a pynvml-compatible module object with simulated GPUs (default "H100 80GB HBM3").

Only `--simulate` constructs it; the real code path imports `pynvml` and nothing from here. It speaks
pynvml's language exactly: pynvml's own NVMLError subclasses, ctypes structs and constants, all taken
from the installed pynvml. Functions it does not implement look missing, as on an old driver. It is as
unkind as a driver: nothing answers before nvmlInit or after nvmlShutdown, samples go missing while a
GPU idles and their spacing is jittered, counters wrap, boards lack what boards lack.

Its own CPU is charged to the process that hosts it (the exporter under `--simulate`; nvitop-exporter
too, in bench/): structs it answers in bulk are written as the driver writes them, into the struct's
memory, not member by member through pynvml's Python-level `__setattr__`, a cost no real binding's
answer has. A call's latency is `call_cost`, slept.

The package, from the model up:

    workload.py    the simulated GPUs (DeviceTraits) and what their scenario makes them do over time
    nvml_h.py      the NVML constants and value types the driver speaks
    driver.py      the module object: handles (GPUs, MIG devices), nvmlInit/nvmlShutdown, call cost
    identity.py    system, names, UUIDs, PCI, MIG devices
    readings.py    utilization and its sample buffer, memory, thermal, power, clocks, PCIe
    fields.py      field values, in the value type and width the driver picks
    processes.py   the processes each GPU runs (a processes file, PID namespaces), MPS
    events.py      XID event sets and waits
    gpm.py         GPM samples and metrics

Tests drive it further (faults, a fake clock, older drivers and bindings): tests/nvml_faults.py.
"""
from __future__ import annotations

from exporter.simulated.events import Events
from exporter.simulated.fields import Fields
from exporter.simulated.gpm import Gpm
from exporter.simulated.identity import Identity
from exporter.simulated.nvml_h import NVML_H, PCIE_32_BIT, H
from exporter.simulated.processes import Processes
from exporter.simulated.readings import Readings
from exporter.simulated.workload import (
    CO_TENANT_BYTES,
    CO_TENANT_PID,
    CO_TENANT_SM,
    FAULT_AFTER,
    GIB,
    MIB,
    PCIE_RX_BUSY_RATE,
    PCIE_RX_RATE,
    PCIE_TX_RATE,
    SCENARIOS,
    DeviceTraits,
    simulated_uuid,
)

__all__ = ["CO_TENANT_BYTES", "CO_TENANT_PID", "CO_TENANT_SM", "FAULT_AFTER", "GIB", "H", "MIB", "NVML_H",
           "PCIE_32_BIT", "PCIE_RX_BUSY_RATE", "PCIE_RX_RATE", "PCIE_TX_RATE", "SCENARIOS", "DeviceTraits",
           "SimulatedNVML", "simulated_uuid"]


class SimulatedNVML(Identity, Readings, Fields, Processes, Events, Gpm):
    """The simulated NVML: `SimulatedNVML(scenario, gpus, devices=..., call_cost=..., phase_seconds=...,
    leak_minutes=..., processes=...)`, then used as the `pynvml` module."""
