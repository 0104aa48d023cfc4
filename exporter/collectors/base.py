"""What a collector is, and the context it reads NVML through during one GPU sample."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from exporter.nvml import Absent, CallFailed, Device, FieldValue
from exporter.textformat import Values

FieldKey = tuple[int, int]


class Collector:
    """One NVML concern for one GPU. Subclasses set `name` and implement `collect`.

    A collector instance belongs to one GPU and is only ever run by that GPU's sampler thread, so
    it may keep state (counters integrated between samples) without locking.
    `period` is in seconds: slow-changing readings run once per `period` (every sample when the sample
    interval is as long), spread over different samples so that no sample pays for all of them at once.
    """

    name: ClassVar[str] = ""
    period: ClassVar[float] = 0.0  # seconds; 0: every sample
    default_enabled: ClassVar[bool] = True
    help: ClassVar[str] = ""

    def __init__(self, device: Device, *, idle_threshold: float = 0.05, interval: float = 1.0, **_: Any) -> None:
        self.device = device
        self.idle_threshold = idle_threshold
        # A longer gap between two readings means readings were lost (a hang, a lost GPU): that
        # time is attributed to nothing rather than guessed.
        self.max_gap = max(2.0, 2 * interval)

    def fields(self) -> Iterable[FieldKey]:
        """NVML field ids (with scope) this collector reads from the shared field batch."""
        return ()

    def collect(self, ctx: SampleContext) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Free what NVML allocated for this collector; called once its GPU's thread has stopped."""

    def restart(self) -> None:
        """Forget readings from before a GPU loss: the GPU is back (perhaps reset) and its counters may
        have started again. Called by its GPU's sampler thread."""


class SampleContext:
    """Reads for one collector during one sample; failures become counted errors, absences nothing."""

    __slots__ = ("device", "_fields", "now", "values", "errors")  # one per collector and sample

    def __init__(self, device: Device, fields: dict[FieldKey, Any], now: float) -> None:
        self.device = device
        self._fields = fields
        self.now = now
        self.values: Values = {}
        self.errors: list[str] = []

    def guarded(self, read: Callable[[], Any]) -> Any:
        """Run one NVML read: None when absent or failed (the failure is recorded). GpuLost propagates."""
        try:
            return read()
        except Absent:
            return None
        except CallFailed as exc:
            self.errors.append(exc.error)
            return None

    def call(self, function: str, *args: Any, **kwargs: Any) -> Any:
        """A guarded per-device NVML call."""
        return self.guarded(lambda: self.device.call(function, *args, **kwargs))

    def call_first(self, functions: tuple[str, ...], *args: Any) -> Any:
        """A guarded call of the first of several equivalent functions that exists (newest first)."""
        return self.guarded(lambda: self.device.call_first(functions, *args))

    def field(self, field_id: int, scope: int = 0) -> float | None:
        """A value from the shared field batch; None if unsupported or failed (recorded)."""
        reading = self.counter(field_id, scope)
        return None if reading is None else reading.value

    def counter(self, field_id: int, scope: int = 0) -> FieldValue | None:
        """`field` with the width the driver answered it in (where an unsigned counter wraps)."""
        value = self._fields.get((field_id, scope))
        if isinstance(value, CallFailed):
            self.errors.append(value.error)
            return None
        return value

    def emit_series(self, metric: str, series: dict[tuple[str, ...], float]) -> None:
        """Record every series of `metric` at once ({label values: value}, floats). The dict is shared, never
        copied: a collector whose readings did not change hands back the same dict, whose lines the sampler
        then does not write again; so it must never be mutated once emitted."""
        self.values[metric] = series

    def emit(self, metric: str, value: float | None, *labels: str) -> None:
        """Record one sample; None means "no sample" and is dropped here. (That `metric` is declared in
        SPECS with these labels is checked by the tests, not on each of the ~40 samples a GPU takes a second.)"""
        if value is not None:
            self.values.setdefault(metric, {})[labels] = float(value)
