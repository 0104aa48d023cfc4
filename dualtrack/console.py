"""The `dualtrack` subcommands' console: one-line errors and warnings on stderr (control characters
escaped by trainer_hook.text, the one rule for them), and the durations their flags take."""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

from trainer_hook.text import one_line

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def fail(command: str, message: str, code: int = 1) -> int:
    """Print one error line for `dualtrack COMMAND` on stderr; return the exit code."""
    print(f"dualtrack {command}: error: {one_line(message)}", file=sys.stderr)
    return code


def warner(command: str) -> Callable[[str], None]:
    """A function that prints one warning line for `dualtrack COMMAND` on stderr."""
    def warn(message: str) -> None:
        print(f"dualtrack {command}: warning: {one_line(message)}", file=sys.stderr)
    return warn


def duration(text: str, positive: bool = False) -> float:
    """'90', '90s', '250ms', '15m', '24h', '1d' -> seconds (an argparse type); `positive`: above 0."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 15m, 24h or 1d")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if positive and not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not longer than 0")
    return seconds
