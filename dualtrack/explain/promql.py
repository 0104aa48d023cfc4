"""PromQL text for explain: series selectors with their label values quoted, and durations.

`selector("training_step", run=run, rank=rank)` is `training_step{run="…",rank="…"}`; a value is
quoted as a PromQL string (backslash, double quote and newline escaped), so a run id or a uuid is
never read as PromQL. Matchers other than `=` are `not_equal`, `matching`, `not_matching` and
`one_of` (a regex of literal alternatives).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..prometheus import quote
from .model import HOUR, MINUTE


@dataclass(frozen=True)
class Matcher:
    """A label matcher other than equality: its operator and its (unquoted) value."""

    op: str
    value: str


def not_equal(value: str) -> Matcher:
    return Matcher("!=", value)


def matching(pattern: str) -> Matcher:
    return Matcher("=~", pattern)


def not_matching(pattern: str) -> Matcher:
    return Matcher("!~", pattern)


def one_of(values: Iterable[str]) -> Matcher:
    """Any of `values`, literally (each escaped for the regex)."""
    return matching("|".join(re.escape(value) for value in values))


#: A label's wanted value: equal to a string, a Matcher, or None (the label is not matched).
Label = str | Matcher | None


def matchers(*given: str, **labels: Label) -> str:
    """`given` (matchers already written) and `labels`, comma-separated, without braces."""
    written = [*filter(None, given)]
    for name, wanted in labels.items():
        if isinstance(wanted, Matcher):
            written.append(f"{name}{wanted.op}{quote(wanted.value)}")
        elif wanted is not None:
            written.append(f"{name}={quote(wanted)}")
    return ",".join(written)


def selector(name: str = "", /, *given: str, **labels: Label) -> str:
    """`name{labels}`: a series selector (no name: the braces alone; no label: the name alone)."""
    inside = matchers(*given, **labels)
    return name + "{" + inside + "}" if inside or not name else name


def seconds(value: float) -> str:
    """A PromQL duration in whole seconds ("600s")."""
    return f"{int(value)}s"


def window(value: float) -> str:
    """A PromQL duration as the rules write theirs: in whole hours, else minutes, else seconds ("1h", "2m")."""
    for unit, size in (("h", HOUR), ("m", MINUTE)):
        if value >= size and value % size == 0:
            return f"{value / size:g}{unit}"
    return seconds(value)


def fill(template: str, *given: str, **labels: Label) -> str:
    """`template` with each `{SEL}` (where a rule has no matcher) the selector's braces."""
    return template.replace("{SEL}", selector("", *given, **labels))
