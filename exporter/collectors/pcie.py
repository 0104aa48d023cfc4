"""PCIe throughput and replays. nvidia-smi: `nvidia-smi dmon -s t` (rxpci/txpci), pcie.replay counter.

NVML fields NVML_FI_DEV_PCIE_COUNT_TX_BYTES / _RX_BYTES (byte counters; the rate is taken between
two samples, so nothing blocks; a counter that wraps is followed across the wrap, at the width the
driver answers it in: its value type) and
NVML_FI_DEV_PCIE_REPLAY_COUNTER. Drivers without the byte counters (NOT_SUPPORTED, or
INVALID_ARGUMENT from drivers that predate the field) fall back to nvmlDeviceGetPcieThroughput
(a 20 ms driver-side window, in KiB/s).
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import constant


class PcieCollector(Collector):
    name = "pcie"
    help = "PCIe throughput and replay counter"

    def __init__(self, device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        lib = device.nvml.lib
        self.counters = {"tx": (constant(lib, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES"), lib.NVML_PCIE_UTIL_TX_BYTES),
                         "rx": (constant(lib, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES"), lib.NVML_PCIE_UTIL_RX_BYTES)}
        self.replays = lib.NVML_FI_DEV_PCIE_REPLAY_COUNTER
        self.previous: dict[str, tuple[float, float]] = {}

    def fields(self):
        return [(field_id, 0) for field_id, _ in self.counters.values()] + [(self.replays, 0)]

    def collect(self, ctx: SampleContext) -> None:
        for direction, (field_id, counter) in self.counters.items():
            total = ctx.counter(field_id)
            if total is not None:
                ctx.emit("nvml_gpu_pcie_throughput_bytes_per_second",
                         self._rate(direction, total.value, total.bits, ctx.now), direction)
            elif self.device.lacks_field(field_id):
                kib_per_second = ctx.call("nvmlDeviceGetPcieThroughput", counter)
                ctx.emit("nvml_gpu_pcie_throughput_bytes_per_second",
                         None if kib_per_second is None else kib_per_second * 1024, direction)
        ctx.emit("nvml_gpu_pcie_replay_errors_total", ctx.field(self.replays))

    def _rate(self, direction: str, total: float, bits: int | None, now: float) -> float | None:
        previous = self.previous.get(direction)
        self.previous[direction] = (total, now)
        if previous is None or now <= previous[1]:
            return None
        delta = total - previous[0]
        if delta < 0:
            delta = _wrapped(previous[0], total, bits)
        return None if delta is None else delta / (now - previous[1])


def _wrapped(before: float, after: float, bits: int | None) -> float | None:
    """Bytes between two readings of a `bits`-wide counter that went backwards: a wrap, or None for a
    reset (driver reload). A 64-bit counter wraps only from close to its end; below that, going
    backwards is a reset, wherever it starts (a 64-bit reset below 4 GiB is not a 32-bit wrap)."""
    if bits is None or before >= 1 << bits:
        return None
    modulus = 1 << bits
    if bits < 64 or before > modulus / 2:
        return modulus - before + after
    return None
