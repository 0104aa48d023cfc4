"""The numbers `dualtrack explain` and the rules share: when a slowdown, a straggler, a gradient spike
or a loss-scale collapse is an event, how far back evidence is looked for, and what each infra cause
scores; then explain's own (how finely it reads a run).

One table, no dependencies. rules/distributed.yml (TrainingStragglerRank), rules/alerts.yml
(TrainingGradientExplosion, TrainingLossScaleCollapse, TrainingDataLoaderBottleneck) and
rules/explain.yml (job_run_rank:training_infra_cause:score) are written with these numbers,
`dualtrack explain` reads them from here, and tests/dualtrack/test_thresholds.py parses the rules and
docs/explain.md's cause table and fails when any number differs from this table.
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
STRAGGLER_WAIT_RECOVERED = STRAGGLER_WAIT_GAP / 2
#: A step-time regression: the run's median step time at least REGRESSION_RATIO times its median over
#: the REGRESSION_BASELINE seconds before, for REGRESSION_FOR seconds. A 20 % slowdown is a step time
#: 1.2 times as long (the step rate down to 1 / 1.2, 83 %). The event ends below REGRESSION_RECOVERED.
REGRESSION_RATIO = 1.2
REGRESSION_FOR = 600.0
REGRESSION_BASELINE = 1800.0
REGRESSION_RECOVERED = 1.1
#: TrainingDataLoaderBottleneck: a rank waited for batches more than STARVATION_SHARE of the time
#: (rate over RATE_WINDOW) for STARVATION_FOR seconds: data starvation; explain ends the event below
#: STARVATION_RECOVERED.
STARVATION_SHARE = 0.3
STARVATION_FOR = 240.0
STARVATION_RECOVERED = STARVATION_SHARE / 2
#: TrainingGradientExplosion: the gradient norm's maximum over GRAD_SPIKE_WINDOW seconds above
#: GRAD_SPIKE_FACTOR times its median (quantile GRAD_SPIKE_QUANTILE) over the GRAD_SPIKE_BASELINE seconds
#: before, above GRAD_SPIKE_FLOOR, with at least GRAD_SPIKE_HISTORY samples in that baseline.
GRAD_SPIKE_WINDOW = 120.0
GRAD_SPIKE_BASELINE = 1800.0
GRAD_SPIKE_FACTOR = 10.0
GRAD_SPIKE_QUANTILE = 0.5
GRAD_SPIKE_FLOOR = 1e-4
GRAD_SPIKE_HISTORY = 5
#: TrainingLossScaleCollapse: the loss scale below 1 / LOSS_SCALE_COLLAPSE of its maximum over the last
#: LOSS_SCALE_WINDOW seconds (a scale that drifts down over hours is no collapse).
LOSS_SCALE_COLLAPSE = 1024.0
LOSS_SCALE_WINDOW = 3600.0
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
#: Slowdowns and data starvation are seen through a rate window, late: evidence up to EVIDENCE_LAG
#: seconds (RATE_POINTS points at least) after such an event counts.
EVIDENCE_LAG = 120.0
#: A rank's share of time waiting for data, as a cause: its rate over DATA_WAIT_WINDOW seconds.
DATA_WAIT_WINDOW = 120.0
#: A GPU idle (the gpu_idle throttle reason) more than CLOCK_IDLE seconds of the window lowers its
#: clock by design: no clock_drop.
CLOCK_IDLE = 60.0

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


# explain's own: how finely it reads a run (no rule has these).
#: --since's default: this long before --until.
DEFAULT_LOOKBACK = 7 * 86400.0
#: At most this many points per series in a range query over the whole run, and no step finer than
#: MIN_RESOLUTION seconds (a scrape interval).
MAX_POINTS = 1500
MIN_RESOLUTION = 15.0
#: The lookups that find a run range over its window, at least MIN_SPAN seconds; the run ends
#: END_MARGIN seconds after its last update.
MIN_SPAN = 60.0
END_MARGIN = 60.0
#: Prometheus' lookback: a sample this old is still a series' current value.
LOOKBACK = 300.0
#: A rate window spans at least RATE_POINTS points of the run's resolution.
RATE_POINTS = 4
#: Per-rank hits at most NEAR_POINTS points apart (or steps 1 apart) are one event, whose keys and
#: step are read over that many points (plus LOOKBACK).
NEAR_POINTS = 2
#: An event's time is refined to 1 / REFINE_STEPS of a point (1 s at least).
REFINE_STEPS = 200
#: Gradient spikes more than SPIKE_SEPARATION seconds apart are two events; OOMs, failures and replica
#: divergences within MERGE_WINDOW seconds of each other, one.
SPIKE_SEPARATION = 300.0
MERGE_WINDOW = 300.0
#: A step-time baseline needs REGRESSION_HISTORY points.
REGRESSION_HISTORY = 5
#: Counters are read at COUNTER_POINTS points over the evidence window.
COUNTER_POINTS = 600
#: A delay shorter than AGO_IN_SECONDS is said in seconds ("45 s"), else in minutes ("3 min").
AGO_IN_SECONDS = 120.0
