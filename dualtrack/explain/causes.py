"""Decision: the infra causes of an event, found on its GPUs (its rank) in the window before it, ranked.

CAUSES is the table: a row per way a cause kind is found, with the events it can explain, the words
of its evidence, its score (dualtrack/thresholds.py's SCORES) and its verdict. A Counter row is an
exporter counter that rose in the window (every counter an event wants: one range query); a Probe row
is an instant query at the window's end, whose answer its `read` turns into Findings. find_causes
asks the rows an event wants and ranks what they found; a new cause is a new row.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from exporter import xids

from .. import prometheus
from .. import thresholds as limits
from ..summary import utc
from .events import KINDS, NUMERICS, SEEN_LATE, SLOWDOWNS
from .model import Cause, Event, ago, in_minutes
from .promql import Label, matchers, not_equal, not_matching, one_of, quote, seconds, selector
from .reader import Reader, points

#: A Prometheus answer: its series, each {"metric": labels, "value" or "values"}.
Answer = list[dict[str, Any]]
HARDWARE = "hardware, not the model"
PROCESS_MEMORY = "nvml_gpu_process_memory_used_bytes"
PROCESS_SM = "nvml_gpu_process_sm_utilization_ratio"
#: The process name (comm, 15 bytes) of an MPS server or control daemon.
MPS_SERVER = "nvidia-cuda-mps.*"
#: Hyper-parameters whose change at or just before a numerics event is a cause: name -> series, the
#: first the hook exports (a learning rate's window maximum shows a jump that a rollback undid in the push).
HYPER_PARAMETERS = {"learning_rate": ("training_learning_rate_max", "training_learning_rate"),
                    "loss_scale": ("training_loss_scale",), "batch_size": ("training_batch_size",)}
GIB = float(2**30)


@dataclass(frozen=True)
class Search:
    """Where and when one event's causes are looked for: the exporter's uuids of its rank's GPU (every
    GPU of the run for a run-wide event), from `start` to `at`."""

    event: Event
    run: str  # the run's matchers
    gpus: list[str]
    own: str | None  # the event's rank's GPU (a MIG instance's parent) among `gpus`
    whole: list[str]  # `gpus` but the parents of MIG instances searched
    slices: list[tuple[str, str]]  # (parent uuid, gpu_instance) of the MIG instances searched
    ranks: dict[str, str]  # uuid -> rank
    start: float
    at: float
    res: float

    @classmethod
    def of(cls, reader: Reader, event: Event) -> Search:
        """The search for `event`'s causes: from EVIDENCE_WINDOW before it to the first sample that showed
        it (a slowdown is seen through a rate window: what started in that window counts too)."""
        own = reader.exporter_gpus.get(event.rank) if event.rank is not None else None
        gpus = [own] if own else sorted(set(reader.exporter_gpus.values()))
        # MIG instances (parent uuid, gpu_instance) among them: each has its own memory and is isolated
        # from the other instances' processes, which NVML lists per GPU only (no co-tenant is named).
        ranks = [event.rank] if own else list(reader.exporter_gpus)
        slices = sorted({(reader.parents[r], reader.instances[r]) for r in ranks if r in reader.parents})
        whole = [u for u in gpus if u not in {parent for parent, _ in slices}]
        lag = max(limits.EVIDENCE_LAG, limits.RATE_POINTS * reader.res) if event.kind in SEEN_LATE else 0.0
        ranks_of = {uuid: rank for rank, uuid in reader.exporter_gpus.items()}
        return cls(event, reader.run, gpus, own, whole, slices, ranks_of, event.time - limits.EVIDENCE_WINDOW,
                   event.time + reader.res + lag, reader.res)

    @property
    def range(self) -> str:
        """The window as a PromQL range, up to `at`."""
        return seconds(limits.EVIDENCE_WINDOW + self.res)

    def exporter(self, name: str, uuids: list[str], **labels: Label) -> str:
        """The exporter's series `name` of the GPUs `uuids`."""
        return selector(name, exporter_gpus(uuids), **labels)

    def where(self, uuid: str) -> str:
        """Where a GPU is, as the event's sentence says it."""
        if uuid == self.own:
            return "on that GPU" if self.own == self.event.gpu_uuid else f"on its MIG instance's parent GPU ({uuid})"
        return f"on rank {self.ranks.get(uuid, '?')}'s GPU ({uuid})"


def exporter_gpus(uuids: list[str]) -> str:
    """The matchers of the exporter's series of the GPUs `uuids` (a run's series under another job,
    pushed or remote-written by whoever holds the hook's credentials, are no evidence)."""
    return matchers(job=prometheus.EXPORTER_JOB, uuid=one_of(uuids))


@dataclass(frozen=True)
class Finding:
    """What a row found: the format fields of its evidence and phrase (`uuid`: the GPU), and whether
    it is the kind's severe form (dualtrack/thresholds.py scores both)."""

    fields: dict[str, Any]
    severe: bool = True


def _has_gpus(search: Search) -> bool:
    return bool(search.gpus)


@dataclass(frozen=True, kw_only=True)
class Row:
    """A way a cause of `kind` is found: the events it explains, its evidence and its phrase (format
    fields: its Finding's, `where` the GPU is and the `window`), its verdict for the event's sentence,
    whether a search can ask it (`needs`) and its score (default: SCORES[kind], severe or lesser)."""

    kind: str
    explains: frozenset[str]
    evidence: str
    phrase: str
    verdict: str = HARDWARE
    needs: Callable[[Search], bool] = _has_gpus
    score: Callable[[Finding], float] | None = None

    def __post_init__(self) -> None:
        if self.score is None and self.kind not in limits.SCORES:
            raise ValueError(f"cause {self.kind!r} has no score in dualtrack/thresholds.py")
        if not self.explains or not self.explains <= KINDS:
            raise ValueError(f"cause {self.kind!r} explains {sorted(self.explains)}: not event kinds")

    def cause(self, search: Search, found: Finding) -> Cause:
        """What `found` says, in words, scored."""
        uuid = found.fields.get("uuid")
        fields = _Fields(found.fields, window=in_minutes(limits.EVIDENCE_WINDOW),
                         where=search.where(uuid) if uuid is not None else "")
        score = self.score(found) if self.score is not None else limits.score(self.kind, found.severe)
        return Cause(self.kind, self.evidence.format_map(fields), score, self.phrase.format_map(fields))


@dataclass(frozen=True, kw_only=True)
class Counter(Row):
    """An exporter counter whose rise in the window is a cause (`severe`: a series of the kind's
    severe form, by its labels). Fields: the series' labels, uuid, count, delta, at, meaning."""

    series: str
    severe: Callable[[dict[str, str]], bool]

    def find(self, search: Search, series: dict[str, Any], step: float) -> list[Finding]:
        """The series' rise in the window (a range answer at `step`), if it rose."""
        labels = series["metric"]
        values = points(series)
        if not values:
            return []
        # A series that appears inside the window rose from 0 (an XID series appears with its first XID).
        before = values[0][1] if values[0][0] < search.start + step else 0.0
        rose_at = next((at for at, value in values if value > before), None)
        if rose_at is None:
            return []
        return [Finding({**labels, "uuid": labels.get("uuid", ""), "count": values[-1][1] - before,
                         "delta": ago(search.event.time - rose_at), "at": utc(rose_at),
                         "meaning": xids.meaning(_xid(labels))}, self.severe(labels))]


@dataclass(frozen=True, kw_only=True)
class Probe(Row):
    """A cause found by one instant query at the window's end; `read` turns its answer into Findings."""

    query: Callable[[Search], str]
    read: Callable[[Search, Answer], list[Finding]]


class _Fields(dict[str, Any]):
    """Format fields: a label the series does not carry is empty."""

    def __missing__(self, key: str) -> str:
        return ""


def _xid(labels: dict[str, str]) -> int:
    code = labels.get("xid", "")
    return int(code) if code.isdigit() else 0


def _throttle_query(reasons: tuple[str, ...]) -> Callable[[Search], str]:
    """The share of the window each of `reasons` held the GPUs' clocks down."""
    def query(search: Search) -> str:
        held = search.exporter("nvml_gpu_throttle_seconds_total", search.gpus, reason=one_of(reasons))
        return f"increase({held}[{search.range}]) / {limits.EVIDENCE_WINDOW + search.res}"
    return query


def _throttled(search: Search, answer: Answer) -> list[Finding]:
    """A GPU whose reasons together held its clocks down more than THROTTLE_SHARE, as in the rules."""
    shares: dict[str, dict[str, float]] = {}
    for series in answer:
        labels = series["metric"]
        shares.setdefault(labels.get("uuid", ""), {})[labels.get("reason", "")] = float(series["value"][1])
    found = []
    for uuid, reasons in sorted(shares.items()):
        share, named = sum(reasons.values()), " and ".join(r for r, v in sorted(reasons.items()) if v > 0)
        if share > limits.THROTTLE_SHARE:
            found.append(Finding({"uuid": uuid, "share": share, "named": named, "words": named.replace("_", " ")}))
    return found


def _clock_query(search: Search) -> str:
    """The SM clock's low in the window over its high in the window before, on GPUs that were not idle."""
    clock = search.exporter("nvml_gpu_clock_hertz", search.gpus, clock="sm")
    idle = search.exporter("nvml_gpu_throttle_seconds_total", search.gpus, reason="gpu_idle")
    rng = search.range
    return (f"min_over_time({clock}[{rng}]) / on (uuid, clock) max_over_time({clock}[{rng}] offset {rng}) "
            f"< {limits.CLOCK_DROP} unless on (uuid) increase({idle}[{rng}]) > {limits.CLOCK_IDLE}")


def _link_query(search: Search) -> str:
    """GPUs whose NVLink traffic in the window fell below LINK_DROP of the window before."""
    rate = f"sum by (uuid) (rate({search.exporter('nvml_gpu_nvlink_data_bytes_total', search.gpus)}[{search.range}]"
    return f"{rate})) < {limits.LINK_DROP} * {rate} offset {search.range}))"


def _memory_query(search: Search) -> str:
    """GPUs (a MIG rank: its GPU instance, not the parent) more than MEMORY_FULL full in the window."""
    fills = []
    if search.whole:
        used, total = (search.exporter(name, search.whole) for name in
                       ("nvml_gpu_memory_used_bytes", "nvml_gpu_memory_total_bytes"))
        fills.append(f"{used} / {total}")
    for parent, instance in search.slices:
        used, total = (selector(name, exporter_gpus([parent]), gpu_instance=instance) for name in
                       ("nvml_gpu_mig_memory_used_bytes", "nvml_gpu_mig_memory_total_bytes"))
        fills.append(f"{used} / {total}")
    return " or ".join(f"max_over_time(({fill})[{search.range}:]) > {limits.MEMORY_FULL}" for fill in fills)


def _memory_full(search: Search, answer: Answer) -> list[Finding]:
    found = []
    for series in answer:
        instance = series["metric"].get("gpu_instance")
        found.append(Finding({"uuid": series["metric"].get("uuid", ""), "ratio": float(series["value"][1]),
                              "instance": f" GPU instance {instance}" if instance else "",
                              "memory": f"the memory of GPU instance {instance}" if instance else "the memory"},
                             search.event.kind == "oom"))
    return found


def co_tenants(gpus: str, rng: str, metric: str = PROCESS_MEMORY) -> str:
    """GPU processes of no run in `rng` (rules/explain.yml's co_tenant join), with the most of
    `metric` (a per-process series: memory, or SM utilization) each had: a process is a run's when
    its PID in its own namespace and its start time are a run's pid and start_time (the hook's
    training_process_info), or its PID namespace and its PID in it a run's pid_namespace and pid, or,
    for a run that reports neither, when its PID is the run's pid. A process the exporter could not
    read is never a co-tenant, nor an MPS server (it runs its clients' work). `gpus`: the GPUs' matchers."""
    def runs(**labels: Label) -> str:
        return f"last_over_time({selector('training_process_info', **labels)}[{rng}])"

    processes = selector(metric, gpus, namespace_pid=not_equal(""), process=not_matching(MPS_SERVER))
    return (f'max_over_time({processes}[{rng}]) '
            f'unless on (namespace_pid, start_time) label_join({runs(start_time=not_equal(""))}, '
            '"namespace_pid", "", "pid") '
            f'unless on (pid_namespace, namespace_pid) label_join({runs(pid_namespace=not_equal(""))}, '
            '"namespace_pid", "", "pid") '
            f'unless on (pid) {runs(pid_namespace="", start_time="")}')


def _co_tenant_query(search: Search) -> str:
    """Each process of no run on the whole GPUs: its memory, and its SM utilization where read."""
    gpus = exporter_gpus(search.whole)
    return " or ".join(f'label_replace(max by (uuid, pid, process) ({co_tenants(gpus, search.range, metric)}), '
                       f'"series", {quote(metric)}, "", "")' for metric in (PROCESS_MEMORY, PROCESS_SM))


def _co_tenant_processes(search: Search, answer: Answer) -> list[Finding]:
    """A finding per process, its peak SM utilization where the exporter reads it: one that computed
    (above CO_TENANT_SM) is severe, one that only holds memory is not."""
    by_process: dict[str, dict[tuple[str, str, str], float]] = {PROCESS_MEMORY: {}, PROCESS_SM: {}}
    for series in answer:
        labels = series["metric"]
        key = (labels.get("uuid", ""), labels.get("pid", ""), labels.get("process", ""))
        by_process[labels.get("series", PROCESS_MEMORY)][key] = float(series["value"][1])
    found = []
    for (uuid, pid, process), used in sorted(by_process[PROCESS_MEMORY].items()):
        sm = by_process[PROCESS_SM].get((uuid, pid, process))
        computes = sm is not None and sm > limits.CO_TENANT_SM
        found.append(Finding({"uuid": uuid, "pid": pid, "name": process or "?", "gib": used / GIB,
                              "sm": "" if sm is None else f", {sm:.0%} SM",
                              "computing": f", computing {sm:.0%} of the SMs" if computes else ""}, computes))
    return found


def _data_wait_query(search: Search) -> str:
    """The rank's (the run's ranks') largest share of time waiting for data in the window."""
    short = seconds(max(limits.DATA_WAIT_WINDOW, limits.RATE_POINTS * search.res))
    waited = selector("training_data_wait_seconds_total", search.run, rank=search.event.rank)
    return f"max_over_time(rate({waited}[{short}])[{search.range}:{seconds(search.res)}]) > {limits.DATA_WAIT_SHARE}"


def _data_waits(search: Search, answer: Answer) -> list[Finding]:
    """The rank that waited the most."""
    return [Finding({"rank": s["metric"].get("rank", "?"), "share": float(s["value"][1])})
            for s in sorted(answer, key=lambda s: -float(s["value"][1]))[:1]]


def _hyper_parameters(event: Event) -> dict[str, tuple[str, ...]]:
    """The hyper-parameters that can explain `event` (a loss-scale collapse is the loss scale's own fall)."""
    return {name: series for name, series in HYPER_PARAMETERS.items()
            if not (name == "loss_scale" and event.kind == "loss_scale_collapse")}


def _hyper_query(search: Search) -> str:
    """The rank's logged hyper-parameters from HYPER_WINDOW before the event to the first sample that
    showed it (`at`: numerics events are not seen late)."""
    names = [series for candidates in _hyper_parameters(search.event).values() for series in candidates]
    logged = selector("", search.run, rank=search.event.rank, __name__=one_of(names))
    return f"{logged}[{seconds(limits.HYPER_WINDOW + search.res)}]"


def _hyper_jumps(search: Search, answer: Answer) -> list[Finding]:
    """A hyper-parameter that changed HYPER_JUMP-fold or more from a sample at most HYPER_WINDOW before
    the event to the first sample that showed it: its values before and after."""
    event = search.event
    by_name: dict[str, Answer] = {}
    for series in answer:
        by_name.setdefault(series["metric"].get("__name__", ""), []).append(series)
    found = []
    for name, candidates in _hyper_parameters(event).items():
        logged = next((by_name[series] for series in candidates if series in by_name), [])
        values = [point for series in logged[:1] for point in points(series)]
        after = next((i for i, (at, _) in enumerate(values) if at >= event.time), len(values) - 1)
        for (then, before), (now, value) in reversed(list(itertools.pairwise(values[:after + 1]))):
            if then < event.time - limits.HYPER_WINDOW:
                break
            if before > 0 and value > 0 and max(value / before, before / value) >= limits.HYPER_JUMP:
                found.append(Finding({"name": name, "label": name.replace("_", " "), "before": before, "value": value,
                                      "moved": "jumped" if value > before else "fell", "factor": value / before,
                                      "span": ago(max(now, event.time) - then)}))
                break
    return found


_HEALTH = NUMERICS | SLOWDOWNS | {"replica_divergence", "failed"}  # what a GPU's errors can explain
_LOAD = SLOWDOWNS | {"oom", "failed"}  # what a GPU's memory or its other processes can explain


def _always(search: Search) -> bool:
    return True


#: The table. Ties in score keep its order (the counters' in their answer's).
CAUSES: tuple[Row, ...] = (
    Counter(kind="gpu_lost", series="nvml_exporter_gpu_lost_total", severe=lambda labels: True,
            explains=_HEALTH | {"oom"},
            evidence="{uuid} lost (stopped answering NVML) at {at}, {delta} before",
            phrase="{delta} after a GPU loss {where} (it stopped answering NVML)"),
    Counter(kind="xid", series="nvml_gpu_xid_errors_total", severe=lambda labels: xids.is_disruptive(_xid(labels)),
            explains=_HEALTH | {"oom"},
            evidence="XID {xid} ({meaning}) on {uuid} at {at}, {delta} before",
            phrase="{delta} after XID {xid} ({meaning}) {where}"),
    Counter(kind="ecc", series="nvml_gpu_ecc_errors_total", severe=lambda labels: labels.get("error") == "uncorrected",
            explains=_HEALTH,
            evidence="{count:.0f} {error} ECC error(s) on {uuid}, {delta} before",
            phrase="{delta} after {error} ECC errors {where}"),
    Counter(kind="remapped_rows", series="nvml_gpu_remapped_rows_total",
            severe=lambda labels: labels.get("severity") == "uncorrectable", explains=_HEALTH,
            evidence="{count:.0f} {severity} row(s) remapped on {uuid}, {delta} before",
            phrase="{delta} after {severity} row remapping {where}"),
    Counter(kind="link_drop", series="nvml_gpu_pcie_replay_errors_total", severe=lambda labels: False,
            explains=SLOWDOWNS | {"failed"},  # the lesser link_drop: NVLink traffic halved is the severe one
            evidence="{count:.0f} PCIe replay(s) on {uuid}, {delta} before",
            phrase="{delta} after PCIe replays {where}"),
    Probe(kind="hw_slowdown", query=_throttle_query(("hw_slowdown",)), read=_throttled, explains=SLOWDOWNS,
          evidence="{named} on {uuid} {share:.0%} of the {window} before",
          phrase="with {words} {where} {share:.0%} of the time before"),
    Probe(kind="power_throttle", query=_throttle_query(("sw_power_cap", "hw_power_brake_slowdown")), read=_throttled,
          explains=SLOWDOWNS, evidence="{named} on {uuid} {share:.0%} of the {window} before",
          phrase="with {words} {where} {share:.0%} of the time before"),
    Probe(kind="thermal_throttle", query=_throttle_query(("sw_thermal_slowdown", "hw_thermal_slowdown")),
          read=_throttled, explains=SLOWDOWNS, evidence="{named} on {uuid} {share:.0%} of the {window} before",
          phrase="with {words} {where} {share:.0%} of the time before"),
    Probe(kind="clock_drop", query=_clock_query, explains=SLOWDOWNS,
          read=lambda search, answer: [Finding({"uuid": s["metric"].get("uuid", ""), "ratio": float(s["value"][1])})
                                       for s in answer],
          evidence="SM clock of {uuid} fell to {ratio:.0%} of the {window} before",
          phrase="with the SM clock {where} at {ratio:.0%}"),
    Probe(kind="link_drop", query=_link_query, explains=SLOWDOWNS | {"failed"},
          read=lambda search, answer: [Finding({"uuid": s["metric"].get("uuid", "")}) for s in answer],
          evidence="NVLink traffic of {uuid} halved in the {window} before",
          phrase="with NVLink traffic {where} halved"),
    Probe(kind="memory_pressure", query=_memory_query, read=_memory_full, explains=_LOAD,
          needs=lambda search: bool(search.whole or search.slices), verdict="GPU memory, not the model's numerics",
          evidence="{uuid}{instance} memory {ratio:.0%} full", phrase="with {ratio:.0%} of {memory} used {where}"),
    Probe(kind="co_tenant", query=_co_tenant_query, read=_co_tenant_processes, explains=_LOAD,
          needs=lambda search: bool(search.whole), verdict="another process on the GPU, not the model",
          evidence="process {name} (pid {pid}) of no run on {uuid}, {gib:.1f} GiB{sm}",
          phrase="with another process ({name}, pid {pid}{computing}) {where}"),
    Probe(kind="data_wait", query=_data_wait_query, read=_data_waits, explains=SLOWDOWNS | {"data_starvation"},
          needs=_always, verdict="the input pipeline, not the GPU or the model",
          score=lambda found: limits.data_wait_score(found.fields["share"]),
          evidence="rank {rank} waited for data up to {share:.0%} of the time in the {window} before",
          phrase="with rank {rank} waiting for data {share:.0%} of the time"),
    Probe(kind="hyperparameter", query=_hyper_query, read=_hyper_jumps, explains=NUMERICS,
          needs=lambda search: search.event.rank is not None, verdict="a hyper-parameter change, not the GPU",
          evidence="{name} {moved} from {before:.4g} to {value:.4g} (x{factor:.3g}) in the {span} up to the event",
          phrase="after the {label} {moved} from {before:.4g} to {value:.4g}"),
)


#: The counters' rows by their series.
COUNTERS = {row.series: row for row in CAUSES if isinstance(row, Counter)}


def verdict(kind: str) -> str:
    """What a top cause of `kind` says the event was."""
    return next(row.verdict for row in CAUSES if row.kind == kind)


def find_causes(reader: Reader, event: Event) -> list[Cause]:
    """The infra evidence on the event's GPU (all the run's GPUs for a run-wide event), ranked."""
    search = Search.of(reader, event)
    rows = [row for row in CAUSES if event.kind in row.explains and row.needs(search)]
    counters = [row.series for row in rows if isinstance(row, Counter)]
    causes: list[Cause] = []
    if counters:
        step = max(1.0, (search.at - search.start) / limits.COUNTER_POINTS)
        answer = reader.client.query_range(counter_query(search, counters), search.start, search.at, step)
        causes = counter_causes(search, answer, step)
    for probe in (row for row in rows if isinstance(row, Probe)):
        answer = reader.client.query(probe.query(search), search.at)
        causes.extend(probe.cause(search, found) for found in probe.read(search, answer))
    causes.sort(key=lambda c: -c.score)
    where = ", ".join(search.gpus) if search.gpus else "the run's GPUs: the run reports no GPU"
    return causes or [Cause("none_found", f"no infra evidence on {where} in the "
                                          f"{in_minutes(limits.EVIDENCE_WINDOW)} before", 0.0, "")]


def counter_query(search: Search, counters: list[str]) -> str:
    """The exporter's `counters` of the search's GPUs, one selector (read over the window)."""
    return selector("", exporter_gpus(search.gpus), __name__=one_of(counters))


def counter_causes(search: Search, answer: Answer, step: float) -> list[Cause]:
    """A cause per series of COUNTERS in `answer` (a range query over the search's window at `step`)
    that rose in the window."""
    return [counter.cause(search, found) for series in answer
            if (counter := COUNTERS.get(series["metric"].get("__name__", ""))) is not None
            for found in counter.find(search, series, step)]
