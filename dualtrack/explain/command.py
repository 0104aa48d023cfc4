"""The command: `dualtrack explain RUN` flags, --since/--until, exit codes, text or JSON out."""
from __future__ import annotations

import argparse
import json
import math
import re
import time
from datetime import datetime, timezone

from .. import prometheus
from .. import thresholds as limits
from ..console import duration, fail, warner
from .model import ExplainError
from .render import render_text, to_json
from .timeline import timeline

HELP = "explain a run: its model-track events (NaN, slowdowns, stragglers, OOM...) and the GPU evidence before each"
warn = warner("explain")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="RUN", help="the run id (the `run` label of its training_* series)")
    prometheus.add_arguments(parser, "where the run's training and GPU series are")
    parser.add_argument("--since", metavar="TIME", default=None,
                        help="look for the run from TIME: unix seconds, ISO 8601 (2026-12-03T10:00:00Z) "
                             "or a duration ago (90m, 6h, 2d); default 7 days before --until")
    parser.add_argument("--until", metavar="TIME", default=None, help="... up to TIME (default: now)")
    parser.add_argument("--launch", metavar="ID", default=None,
                        help="the launch to explain when the run id was launched more than once (default: the "
                             "latest in the window; the others are listed)")
    parser.add_argument("--json", action="store_true", help="print the timeline as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        now = time.time()
        until = parse_time(args.until, now, "--until") if args.until else now
        since = parse_time(args.since, now, "--since") if args.since else until - limits.DEFAULT_LOOKBACK
        if since >= until:
            raise ValueError("--since must be before --until")
        for name, value in (("RUN", args.run_id), ("--launch", args.launch or "")):
            utf8(value, name)
        client = prometheus.from_args(args, warn)
    except ValueError as exc:
        return fail("explain", str(exc), 2)
    if client is None:
        return fail("explain", f"no Prometheus: pass --prometheus URL or set ${prometheus.ENV_URL}", 2)
    try:
        found = timeline(client, args.run_id, since, until, args.launch)
    except ExplainError as exc:
        return fail("explain", str(exc))
    except prometheus.QueryError as exc:
        return fail("explain", f"{client.url}: {exc}")
    print(json.dumps(to_json(found), indent=1) if args.json else render_text(found))
    return 0


def utf8(text: str, name: str) -> None:
    """Raises ValueError when `text` (an argument undecodable bytes turned into surrogates) is not
    UTF-8 text: no label value is anything else."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{name} {text!r}: not UTF-8 text") from None


def parse_time(text: str, now: float, flag: str) -> float:
    """Unix seconds, ISO 8601, or a duration ago (30s, 90m, 6h, 2d); finite. Raises ValueError."""
    found = _parse_time(text, now, flag)
    if not math.isfinite(found):
        raise ValueError(f"{flag} {text!r}: not a finite time")
    return found


def _parse_time(text: str, now: float, flag: str) -> float:
    if text.strip()[-1:].isalpha():  # a duration with its unit (6h): that long ago; else ISO 8601 (...Z)
        try:
            return now - duration(text)
        except argparse.ArgumentTypeError:
            pass
    try:
        return float(text)
    except ValueError:
        pass
    try:
        # Python 3.10's fromisoformat does not read the "Z" of UTC.
        parsed = datetime.fromisoformat(re.sub(r"[zZ]$", "+00:00", text.strip()))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: not unix seconds, ISO 8601 or a duration like 6h") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()
