"""The `dualtrack` subcommands' errors and warnings: one line each on stderr, control characters escaped."""
from __future__ import annotations

import sys
from typing import Callable

from trainer_hook.text import one_line


def fail(command: str, message: str, code: int = 1) -> int:
    """Print one error line for `dualtrack COMMAND` on stderr; return the exit code."""
    print(f"dualtrack {command}: error: {one_line(message)}", file=sys.stderr)
    return code


def warner(command: str) -> Callable[[str], None]:
    """A function that prints one warning line for `dualtrack COMMAND` on stderr."""
    def warn(message: str) -> None:
        print(f"dualtrack {command}: warning: {one_line(message)}", file=sys.stderr)
    return warn
