"""What the hook and the exporter declare they export: the series names and labels the static name test
(tests/repo/test_names.py) and the dashboard tests check everything else against."""
from __future__ import annotations

from dualtrack import openmetrics
from exporter import metrics
from trainer_hook import contract

PREFIXES = ("training_", "nvml_")


def hook_series() -> dict[str, frozenset[str] | None]:
    """Every sample name the hook exports -> its labels (None: any label, as training_run_info's config)."""
    # job, run, rank, instance: the hook's own; `dualtrack replay` marks the series it writes
    own = contract.RESERVED_LABELS - {"le", "quantile"} | {openmetrics.REPLAY_LABEL}
    names: dict[str, frozenset[str] | None] = {}
    for series in (*contract.SERIES, *map(contract.logged_series, contract.KNOWN_KEYS)):
        samples = series.sample_names()  # the family name first: a counter's or histogram's is no series
        for sample in samples if series.type == "gauge" else samples[1:]:
            extra = {"le"} if sample.endswith("_bucket") else set()
            names[contract.PREFIX + sample] = own | set(series.labels) | extra
    names[contract.PREFIX + "run_info"] = None
    return names


def hook_families() -> frozenset[str]:
    """The hook's family names that are no series' name (a counter's without _total, a histogram's)."""
    return frozenset(contract.PREFIX + series.name for series in contract.SERIES if series.type != "gauge")


def exporter_series() -> dict[str, frozenset[str]]:
    """Every family the exporter serves (exporter.metrics' MetricSpec table) -> its labels."""
    per_gpu = {spec.name for spec in metrics.GPU_METRICS}
    specs: set[metrics.MetricSpec] = set()
    for value in vars(metrics).values():
        if isinstance(value, metrics.MetricSpec):
            specs.add(value)
        elif isinstance(value, tuple) and value and all(isinstance(v, metrics.MetricSpec) for v in value):
            specs.update(value)
    return {spec.name: frozenset(spec.labels) | (frozenset(metrics.GPU_LABELS) if spec.name in per_gpu else set())
            for spec in specs if spec.name.startswith(PREFIXES)}
