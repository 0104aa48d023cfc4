"""The numbers `dualtrack explain` and the rules share: when a slowdown or a straggler is an event,
how far back evidence is looked for, and what each infra cause scores.

One table, no dependencies. rules/distributed.yml (TrainingStragglerRank) and rules/explain.yml
(job_run_rank:training_infra_cause:score) are written with these numbers, `dualtrack explain` reads
them from here, and tests/dualtrack/test_thresholds.py parses the rules and docs/explain.md's cause table and
fails when any number differs from this table.
"""
from __future__ import annotations

#: Steps per second are rate(training_steps_total[5m]), in the rules and in explain.
RATE_WINDOW = 300.0
#: TrainingStragglerRank: a rank stepping below STRAGGLER_SHARE of its run's median rank rate for
#: STRAGGLER_FOR seconds is a straggler; explain ends the event when it is back above STRAGGLER_RECOVERED.
STRAGGLER_SHARE = 0.75
STRAGGLER_FOR = 600.0
STRAGGLER_RECOVERED = 0.9
#: TrainingStragglerRank under synchronous data parallelism (ranks that wait for each other in every
#: step's all-reduce, so their step rates are equal): a rank whose share of step time spent waiting in
#: the collectives (rates over STRAGGLER_WAIT_WINDOW) is STRAGGLER_WAIT_GAP or more below its run's
#: largest share, for STRAGGLER_WAIT_FOR seconds: the others lose that share of each step waiting for it
#: (0.2: a rank 25 % slower than its peers, as STRAGGLER_SHARE). The event ends below half the gap.
STRAGGLER_WAIT_GAP = 0.2
STRAGGLER_WAIT_WINDOW = 120.0
STRAGGLER_WAIT_FOR = 300.0
#: A step-time regression: the run's median step time at least REGRESSION_RATIO times its median over
#: the REGRESSION_BASELINE seconds before, for REGRESSION_FOR seconds. A 20 % slowdown is a step time
#: 1.2 times as long (the step rate down to 1 / 1.2, 83 %). The event ends below REGRESSION_RECOVERED.
REGRESSION_RATIO = 1.2
REGRESSION_FOR = 600.0
REGRESSION_BASELINE = 1800.0
REGRESSION_RECOVERED = 1.1
#: TrainingDataLoaderBottleneck: a rank waited for batches more than STARVATION_SHARE of the time
#: (rate over 5 min) for STARVATION_FOR seconds: data starvation.
STARVATION_SHARE = 0.3
STARVATION_FOR = 240.0
#: A pause (monitor.paused()) holds back TrainingRankHung and TrainingStalled for at most PAUSE_MAX
#: seconds (rules/pause.yml's job_run:training_pause:seconds); past it, TrainingPauseTooLong fires.
PAUSE_MAX = 900.0

#: Infra evidence is looked for in this window before an event (the rules' [10m]).
EVIDENCE_WINDOW = 600.0
#: A throttle counts when its reasons held the clocks down more than this share of the window.
THROTTLE_SHARE = 0.05
#: A co-tenant computes when its SM utilization went above this in the window.
CO_TENANT_SM = 0.05
#: A GPU's memory (a MIG instance's) is under pressure above this fill.
MEMORY_FULL = 0.95
#: A clock drop: the SM clock below this share of its maximum in the window before.
CLOCK_DROP = 0.8
#: A link drop: NVLink traffic below this share of the window before.
LINK_DROP = 0.5
#: A rank waited for data more than this share of the time: the input pipeline is a cause.
DATA_WAIT_SHARE = 0.2
#: A hyper-parameter (learning rate, loss scale, batch size) that changed by this factor or more, up or
#: down, between two samples, the earlier within HYPER_WINDOW seconds before a numerics event: a cause.
HYPER_JUMP = 2.0
HYPER_WINDOW = 120.0

#: Each cause's score (its severe form) and, where it has one, its lesser form's: an XID that does not
#: stop the work (exporter/xids.py), corrected ECC errors, correctable row remaps, a co-tenant that only
#: holds memory, memory pressure before anything but an OOM, PCIe replays (NVLink traffic halved is the
#: severe form of link_drop). `data_wait` scores its share plus DATA_WAIT_BONUS, at most DATA_WAIT_MAX.
SCORES: dict[str, tuple[float, float | None]] = {
    "gpu_lost": (0.99, None),  # outranks every other cause, XID 79 included
    "xid": (0.95, 0.3),
    "ecc": (0.9, 0.3),
    "remapped_rows": (0.85, 0.4),
    "co_tenant": (0.75, 0.7),
    "thermal_throttle": (0.6, None),
    "power_throttle": (0.55, None),
    "hw_slowdown": (0.55, None),
    "memory_pressure": (0.8, 0.5),
    "link_drop": (0.5, 0.4),
    "clock_drop": (0.45, None),
    "hyperparameter": (0.8, None),
}
DATA_WAIT_BONUS = 0.2
DATA_WAIT_MAX = 0.9
#: The causes rules/explain.yml records (every score there: the severe form; co_tenant both).
RECORDED = ("gpu_lost", "xid", "ecc", "remapped_rows", "thermal_throttle", "power_throttle", "hw_slowdown",
            "co_tenant")


def score(kind: str, severe: bool = True) -> float:
    """The score of a cause of `kind`, in its severe or its lesser form."""
    top, lesser = SCORES[kind]
    return top if severe or lesser is None else lesser


def data_wait_score(share: float) -> float:
    """The score of a rank that waited for data `share` of the time."""
    return round(min(DATA_WAIT_MAX, share + DATA_WAIT_BONUS), 2)
