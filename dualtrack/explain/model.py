"""What an explanation is made of: a run's Timeline of Events, each with its ranked Causes."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from .. import thresholds as limits

#: Seconds in a minute, an hour.
MINUTE = 60.0
HOUR = 60 * MINUTE


class ExplainError(Exception):
    """The run cannot be explained (not found); one line."""


@dataclass
class Cause:
    """Infra evidence found before an event: its kind, its words, its score (dualtrack/thresholds.py)."""

    kind: str
    evidence: str
    score: float
    phrase: str = field(default="", repr=False)  # short form for the event's sentence


@dataclass
class Event:
    """A model-track event of one rank (None: the whole run) at `time`, and what explains it."""

    kind: str
    step: int | None
    time: float
    rank: str | None
    gpu_uuid: str | None
    detail: str
    others: list[str] = field(default_factory=list)  # other ranks affected
    causes: list[Cause] = field(default_factory=list)
    sentence: str = ""


@dataclass
class Timeline:
    """A run's (a launch's) events in time order, and the GPUs its ranks trained on."""

    run: str
    job: str
    start: float
    end: float
    gpus: dict[str, str]  # rank -> uuid
    events: list[Event]
    parent_gpus: dict[str, str] = field(default_factory=dict)  # rank on a MIG instance -> its parent GPU's uuid
    launch: str | None = None  # the launch explained (None: the run names none)
    other_launches: list[dict[str, Any]] = field(default_factory=list)  # {"launch", "start"} of the others


def rank_key(rank: str) -> tuple[int, str]:
    """Ranks in numeric order, names after them."""
    return (int(rank), "") if rank.isdigit() else (sys.maxsize, rank)


def in_minutes(seconds: float) -> str:
    """A duration in whole minutes, as the text says it ("10 min")."""
    return f"{seconds / MINUTE:.0f} min"


def ago(seconds: float) -> str:
    """How long before: in seconds up to AGO_IN_SECONDS ("45 s"), else in minutes."""
    seconds = max(0.0, seconds)
    return f"{seconds:.0f} s" if seconds < limits.AGO_IN_SECONDS else in_minutes(seconds)
