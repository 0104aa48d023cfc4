"""PCIe throughput and replays. nvidia-smi: `nvidia-smi dmon -s t` (rxpci/txpci), pcie.replay counter.

NVML fields NVML_FI_DEV_PCIE_COUNT_TX_BYTES / _RX_BYTES: byte counters that nvml.h says "can be wrapped".
Answered at 64 bits (their value type), the rate is taken between two samples, so nothing blocks, and
a counter that wraps is followed across the wrap. Answered at 32 bits, they give no rate: at Gen4/Gen5
rates a 32-bit counter wraps several times a second, and no wrap count can be told from two readings.
Then, and where the driver lacks the fields (NOT_SUPPORTED, or INVALID_ARGUMENT from drivers that predate
them), the rate comes from GPM's PCIe metrics (NVML_GPM_METRIC_PCIE_TX_PER_SEC / _RX_PER_SEC, MiB/s over
the window between two samples) on GPUs with GPM (Hopper and later, outside MIG mode), else from
nvmlDeviceGetPcieThroughput (a 20 ms driver-side window, in KiB/s).
NVML_FI_DEV_PCIE_REPLAY_COUNTER is the replay counter.
"""
from __future__ import annotations

from exporter.collectors.base import Collector, SampleContext
from exporter.collectors.gpm import GpmWindow, gpm_supported
from exporter.nvml import constant

MIB = 1024 * 1024
COUNTER_BITS = 64  # the narrowest counter width a rate is taken from (a 32-bit one wraps within a second)
GPM_PCIE = {"tx": "NVML_GPM_METRIC_PCIE_TX_PER_SEC", "rx": "NVML_GPM_METRIC_PCIE_RX_PER_SEC"}


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
        self.gpm: bool | None = None  # whether the GPU has GPM; None until asked
        self.window = GpmWindow(device, lambda buffer: device.call("nvmlGpmSampleGet", buffer), GPM_PCIE, MIB)

    def fields(self):
        return [(field_id, 0) for field_id, _ in self.counters.values()] + [(self.replays, 0)]

    def collect(self, ctx: SampleContext) -> None:
        unusable = []  # directions whose counter is 32 bits wide or absent
        for direction, (field_id, _) in self.counters.items():
            total = ctx.counter(field_id)
            if total is not None and (total.bits is None or total.bits >= COUNTER_BITS):
                ctx.emit("nvml_gpu_pcie_throughput_bytes_per_second",
                         self._rate(direction, total.value, total.bits, ctx.now), direction)
            elif total is not None or self.device.lacks_field(field_id):
                unusable.append(direction)
        if unusable:
            self._without_counters(ctx, unusable)
        ctx.emit("nvml_gpu_pcie_replay_errors_total", ctx.field(self.replays))

    def _without_counters(self, ctx: SampleContext, directions: list[str]) -> None:
        """The rate of `directions` from GPM where the GPU has it, else from nvmlDeviceGetPcieThroughput."""
        if self.gpm is None:
            self.gpm = gpm_supported(ctx, self.device)
        if self.gpm and not self.device.lacks("nvmlGpmSampleGet"):
            rates = self.window.read(ctx)
            for direction in directions:
                ctx.emit("nvml_gpu_pcie_throughput_bytes_per_second", rates.get(direction), direction)
            if not self.device.lacks("nvmlGpmSampleGet"):  # answered (or failed): no second source
                return
        for direction in directions:
            kib_per_second = ctx.call("nvmlDeviceGetPcieThroughput", self.counters[direction][1])
            ctx.emit("nvml_gpu_pcie_throughput_bytes_per_second",
                     None if kib_per_second is None else kib_per_second * 1024, direction)

    def _rate(self, direction: str, total: float, bits: int | None, now: float) -> float | None:
        previous = self.previous.get(direction)
        self.previous[direction] = (total, now)
        if previous is None or now <= previous[1]:
            return None
        delta: float | None = total - previous[0]
        if delta is not None and delta < 0:
            delta = _wrapped(previous[0], total, bits)
        return None if delta is None else delta / (now - previous[1])

    def restart(self) -> None:
        self.previous.clear()
        self.window.restart()

    def close(self) -> None:
        self.window.close()


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
