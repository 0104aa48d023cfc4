"""The simulated GPUs and what they run: each GPU's traits (`DeviceTraits`) and the workload of its
scenario as a function of time (`Workload`). No NVML here: the driver modules answer from this model.

Scenarios: healthy, input-bound (2 s busy / 2 s waiting for data), memory-leak (used memory climbing
in steps until full), demo (healthy -> input-bound -> memory-leak, `phase_seconds` each), and three
faults that start FAULT_AFTER seconds in (what `dualtrack explain` names): thermal-throttle (thermal
slowdown, SM clock down), xid (one XID 79) and co-tenant (another process on the GPU, holding
12 GiB and taking 40 % of the SMs). A list of scenarios gives GPU i the i-th (cycling), so one daemon
serves a sweep's healthy, input-bound and leaking GPUs side by side.
"""
from __future__ import annotations

import math
import threading
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field

SCENARIOS = ("healthy", "input-bound", "memory-leak", "demo", "thermal-throttle", "xid", "co-tenant")
FAULTS = ("thermal-throttle", "xid", "co-tenant")
#: The fault scenarios (thermal-throttle, xid, co-tenant) run healthy this long first (seconds).
FAULT_AFTER = 30.0
THROTTLED_SM_MHZ = 1200
CO_TENANT_PID = 4242
CO_TENANT_BYTES = 12 * (1 << 30)
CO_TENANT_SM = 0.4  # the co-tenant's share of the SMs, taken from the GPU's training processes
GIB = 1 << 30
MIB = 1 << 20
MIG_SLOTS = 7  # nvmlDeviceGetMaxMigDeviceCount of an H100
MIG_INSTANCES = 2  # a GPU in MIG mode is split into two GPU instances (ids 1 and 2)
TICK = 0.1  # seconds: the step of the simulated workload's busy-time integral
# The PCIe byte counters start this close to 2**64 and wrap a few seconds into a run, as any
# counter eventually does.
PCIE_COUNTER_START = 2**64 - 6 * 10**9
PCIE_TX_RATE, PCIE_RX_RATE, PCIE_RX_BUSY_RATE = 0.5e9, 1.5e9, 4e9  # bytes/s: idle, and more received while busy


@dataclass
class DeviceTraits:
    """What one simulated GPU is and supports."""

    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 81559 * MIB
    fans: int = 0  # SXM boards are passively cooled
    power: bool = True
    mig: bool = False
    gpm: bool = True
    nvlinks: int = 18
    nvlink5: bool = False  # Blackwell: NVLink counters in fields COUNT_XMIT/RCV_BYTES, THROUGHPUT_DATA absent
    compute_instances: int = 1  # per GPU instance in MIG mode: each is a MIG device of its own
    sample_period: float = 1 / 6  # seconds between utilization samples, on average (1/6 s to 1 s by product)
    process_utilization: bool = True  # nvmlDeviceGetProcessUtilization (NOT_SUPPORTED on some boards)
    # MPS: the PID of the MPS server (0: no MPS). The compute process list then holds the server alone
    # (as drivers have answered for its clients), nvmlDeviceGetMPSComputeRunningProcesses the clients
    mps_server: int = 0
    # NVML_VALUE_TYPE_* a field is answered in, where not unsigned long long (the driver picks it per
    # field): an unsigned value wraps at its width
    field_types: dict[int, int] = dataclass_field(default_factory=dict)
    # GPM metric ids (NVML_GPM_METRIC_*) the GPU answers NaN for, with NVML_SUCCESS
    gpm_nan_metrics: tuple[int, ...] = ()


def simulated_uuid(index: int) -> str:
    """The UUID of simulated GPU `index` (stable, so a demo run can name the GPU it trains on): the UUID
    version 5 of a URL, computed with CPython's own SHA-1 where there is one, because uuid5's hashlib loads
    libcrypto (3.5 MB resident), which the exporter on real GPUs never loads."""
    try:
        from _sha1 import sha1  # type: ignore[import-not-found]  # CPython's, without stubs
    except ImportError:
        from hashlib import sha1
    digest = sha1(uuidlib.NAMESPACE_URL.bytes + f"dualtrack-simulated-{index}".encode()).digest()
    return f"GPU-{uuidlib.UUID(bytes=digest[:16], version=5)}"


class Workload:
    """What each simulated GPU does at time `t` (seconds since the simulation started)."""

    def __init__(self, scenarios: Sequence[str], traits: list[DeviceTraits], *, phase_seconds: float = 300.0,
                 leak_minutes: float = 30.0) -> None:
        unknown = [name for name in scenarios if name not in SCENARIOS]
        if unknown or not scenarios:
            raise ValueError(f"unknown scenario {', '.join(unknown) or '(none)'}; choose from {', '.join(SCENARIOS)}")
        self.scenarios = tuple(scenarios)
        self.traits = traits
        self.phase_seconds = phase_seconds
        self.leak_minutes = leak_minutes
        self._lock = threading.Lock()
        self._integral = [(0.0, 0.0)] * len(traits)  # (t, busy seconds up to t), advanced tick by tick

    def _phase(self, gpu: int, t: float) -> tuple[str, float]:
        scenario = self.scenarios[gpu % len(self.scenarios)]
        if scenario != "demo":
            return scenario, t
        phase = int(t // self.phase_seconds)
        return ("healthy", "input-bound", "memory-leak")[phase % 3], t - phase * self.phase_seconds

    def faulty(self, gpu: int, t: float) -> str | None:
        """The fault scenario of `gpu` once it has started (FAULT_AFTER seconds in), else None."""
        scenario = self.scenarios[gpu % len(self.scenarios)]
        return scenario if scenario in FAULTS and t >= FAULT_AFTER else None

    def utilization(self, gpu: int, t: float) -> float:
        """GPU utilization (0..1) of the simulated workload at time t."""
        scenario, local = self._phase(gpu, t)
        if scenario == "input-bound":
            return 1.0 if local % 4.0 < 2.0 else 0.0
        return 0.93 + 0.04 * math.sin(2 * math.pi * t / 60 + gpu)

    def busy_seconds(self, gpu: int, t: float) -> float:
        """Integral of utilization from start to t, advanced in TICK steps."""
        with self._lock:
            done, total = self._integral[gpu]
            if t < done:
                return total - (done - t) * self.utilization(gpu, t)
            while done + TICK <= t:
                total += self.utilization(gpu, done + TICK / 2) * TICK
                done += TICK
            self._integral[gpu] = (done, total)
        return total + (t - done) * self.utilization(gpu, t)

    def memory_used(self, gpu: int, t: float) -> int:
        scenario, local = self._phase(gpu, t)
        total = self.traits[gpu].memory_total
        if scenario != "memory-leak":
            return 61 * GIB + gpu * 256 * MIB + (CO_TENANT_BYTES if self.faulty(gpu, t) == "co-tenant" else 0)
        step_seconds = 30.0
        steps = max(1.0, self.leak_minutes * 60 / step_seconds)
        base = 20 * GIB
        used = base + (total - 512 * MIB - base) * math.floor(local / step_seconds) / steps
        return int(min(used, total - 512 * MIB))

    def power_mw(self, gpu: int, t: float) -> int:
        return int((90 + 560 * self.utilization(gpu, t)) * 1000)

    def energy_mj(self, gpu: int, t: float) -> int:
        return int((90 * t + 560 * self.busy_seconds(gpu, t)) * 1000)

