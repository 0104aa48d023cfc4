"""`dualtrack janitor`: delete the Pushgateway groups of training runs that are over.

A run deletes its own group `delete_after` seconds after it ends. A run killed without a word
(SIGKILL, node loss, a SIGTERM before its deletion was due) leaves its group behind; the janitor
removes it. It deletes a group only when both hold:
- the group carries dualtrack's run metrics: `training_run_state` and the grouping labels `run` and
  `rank` (another job's group is never touched);
- its last push (`push_time_seconds`) is older than the retention: `--finished-retention` for a run
  whose last push said finished or failed, `--retention` for one still marked running (a live run
  pushes every few seconds; a dead one raises TrainingMetricsStale meanwhile).
Ages are read on the Pushgateway's own clock, never the janitor's: a push time is compared with the
`Date` of the Pushgateway's answer (else with the newest push time it lists), so a janitor whose
clock is off by minutes or days deletes nothing early. A push time that is not a finite positive
number is a malformed group: never deleted. Redirects are not followed.
An unreachable Pushgateway or a malformed group is logged and retried on the next pass. Label values
and errors are logged with their control characters escaped (a pushed label cannot forge log lines).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import requests

from trainer_hook.connection import allow_insecure, check_transport, push_handler, read_secret, send, session
from trainer_hook.credentials import ENV_PUSHGATEWAY, pushgateway
from trainer_hook.text import one_line

from .console import duration

HELP = "delete the Pushgateway groups of finished or dead training runs after a retention"
DEFAULT_PUSHGATEWAY = "http://127.0.0.1:9091"

log = logging.getLogger("dualtrack.janitor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pushgateway", metavar="URL", default=None,
                        help=f"the Pushgateway (default: $DUALTRACK_PUSHGATEWAY, else {DEFAULT_PUSHGATEWAY}); "
                             "credentials from $DUALTRACK_PUSHGATEWAY_USERNAME/_PASSWORD or _TOKEN, "
                             "CA from $DUALTRACK_PUSHGATEWAY_CA_FILE, as for the hook")
    parser.add_argument("--pushgateway-password-file", metavar="FILE", type=Path, default=None,
                        help="read the password from this file (its first line) instead of "
                             "$DUALTRACK_PUSHGATEWAY_PASSWORD; the user is $DUALTRACK_PUSHGATEWAY_USERNAME")
    parser.add_argument("--retention", type=duration, default=duration("24h"), metavar="DURATION",
                        help="delete a run still marked running whose last push is older than this "
                             "(killed without a word; default 24h)")
    parser.add_argument("--finished-retention", type=duration, default=duration("10m"), metavar="DURATION",
                        help="delete a finished or failed run whose last push is older than this "
                             "(its own deletion did not happen; default 10m)")
    parser.add_argument("--interval", type=duration, default=duration("1m"), metavar="DURATION",
                        help="time between two passes (default 1m)")
    parser.add_argument("--timeout", type=duration, default=duration("10s"), metavar="DURATION",
                        help="timeout of each request to the Pushgateway (default 10s)")
    parser.add_argument("--once", action="store_true",
                        help="one pass, then exit (status 1 if the Pushgateway could not be read)")
    parser.add_argument("--dry-run", action="store_true", help="log what would be deleted, delete nothing")


def run(args: argparse.Namespace) -> int:
    if min(args.interval, args.timeout) <= 0:
        return _usage_error("--interval and --timeout must be longer than 0")
    url = args.pushgateway or os.environ.get(ENV_PUSHGATEWAY) or DEFAULT_PUSHGATEWAY
    try:  # the hook's rule and variables ($DUALTRACK_PUSHGATEWAY_USERNAME/_PASSWORD, _TOKEN, _CA_FILE)
        password = read_secret(args.pushgateway_password_file, "--pushgateway-password-file")
        username = os.environ.get(f"{ENV_PUSHGATEWAY}_USERNAME")
        if password is not None and not username:
            raise ValueError(f"--pushgateway-password-file needs ${ENV_PUSHGATEWAY}_USERNAME")
        access = pushgateway(url, None if password is None else (username, password))
        client = session(access)
        logging.basicConfig(format="%(asctime)s %(levelname)s janitor: %(message)s")
        log.setLevel(logging.INFO)
        check_transport(access, "Pushgateway", log.warning, allow_insecure())
    except ValueError as exc:
        return _usage_error(str(exc))
    janitor = Janitor(access.url, client, args)
    if args.once:
        deleted = janitor.sweep()
        if deleted is not None:
            log.info("%s: %s", access.url, janitor.outcome(deleted))
        return 0 if deleted is not None else 1
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    log.info("watching %s every %gs (running runs: %gs, finished runs: %gs after their last push)",
             access.url, args.interval, args.retention, args.finished_retention)
    while True:
        janitor.sweep()
        if stop.wait(args.interval):
            return 0


def _usage_error(message: str) -> int:
    print(f"dualtrack janitor: error: {message}", file=sys.stderr)
    return 2


class MalformedGroup(ValueError):
    """A group whose age or state cannot be read."""


class Janitor:
    """One pass at a time: list the groups, delete the runs that are over."""

    def __init__(self, url: str, client: requests.Session, args: argparse.Namespace) -> None:
        self.url = url
        self.session = client  # trainer_hook.connection.session: the listing, with its Date header
        self.handler = push_handler(client)  # prometheus_client's: the deletions
        self.args = args
        self._reported: set[str] = set()  # malformed groups already logged
        self._unreachable = False
        self.due = 0  # groups due for deletion in the last pass (a dry run deletes none of them)
        self.seen = 0  # groups listed in the last pass

    def sweep(self) -> list[dict[str, str]] | None:
        """Delete what is due; return the deleted groups' labels (None: the Pushgateway could not be read)."""
        try:
            response = send(self.session, "GET", self.url + "/api/v1/metrics", self.args.timeout)
            groups = json.loads(response.content)["data"]
            date = response.headers.get("Date")
            if not isinstance(groups, list):
                raise ValueError("'data' is not a list")
        except Exception as exc:  # noqa: BLE001 - unreachable, refused, not a Pushgateway: retry later
            if not self._unreachable:
                log.warning("cannot read the groups of %s: %s; retrying every %gs", self.url, one_line(str(exc)),
                            self.args.interval)
            self._unreachable = True
            return None
        if self._unreachable:
            log.info("%s answers again", self.url)
            self._unreachable = False
        now = _pushgateway_now(date, groups)
        deleted = []
        self.due, self.seen = 0, len(groups)
        for group in groups:
            try:
                verdict = self.verdict(group, now)
            except MalformedGroup as exc:
                key = repr(group.get("labels") if isinstance(group, dict) else group)[:200]
                if key not in self._reported:
                    self._reported.add(key)
                    log.warning("skipping a malformed group %s: %s", key, exc)
                continue
            if verdict is None:
                continue
            self.due += 1
            if self.delete(group["labels"], verdict):
                deleted.append(group["labels"])
        return deleted

    def outcome(self, deleted: list[dict[str, str]]) -> str:
        """One line on the last pass: what was (or, in a dry run, would be) deleted, or that nothing was due."""
        if not self.due:
            return f"nothing due for deletion among {self.seen} group(s)"
        if self.args.dry_run:
            return f"would delete {self.due} of {self.seen} group(s) (dry run: nothing deleted)"
        return f"deleted {len(deleted)} of {self.seen} group(s)" + (
            f" ({self.due - len(deleted)} more due, retried on the next pass)" if len(deleted) < self.due else "")

    def verdict(self, group: Any, now: float | None) -> str | None:
        """Why the group is due for deletion, or None to keep it; `now` is the Pushgateway's time."""
        if not isinstance(group, dict) or not isinstance(group.get("labels"), dict):
            raise MalformedGroup("no grouping labels")
        labels = group["labels"]
        if "training_run_state" not in group or not {"job", "run", "rank"} <= labels.keys():
            return None  # not a dualtrack run: never ours to delete
        try:
            pushed = float(group["push_time_seconds"]["metrics"][0]["value"])
            states = [m["labels"].get("state") for m in group["training_run_state"]["metrics"]
                      if float(m["value"]) == 1]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise MalformedGroup(f"unreadable push_time_seconds or training_run_state ({exc!r})") from None
        if not math.isfinite(pushed) or pushed <= 0:
            raise MalformedGroup(f"push_time_seconds {pushed} is not a time")
        state = "finished" if "finished" in states else "failed" if "failed" in states else "running"
        retention = self.args.retention if state == "running" else self.args.finished_retention
        age = -math.inf if now is None else now - pushed
        if not age > retention:
            return None
        return f"{state}, last push {age:.0f}s ago"

    def delete(self, labels: dict[str, str], why: str) -> bool:
        from prometheus_client import delete_from_gateway

        name = one_line(" ".join(f"{k}={v}" for k, v in sorted(labels.items())))
        if self.args.dry_run:
            log.info("would delete %s (%s)", name, why)
            return False
        grouping = {k: v for k, v in labels.items() if k != "job"}
        try:
            delete_from_gateway(self.url, job=labels["job"], grouping_key=grouping,
                                timeout=self.args.timeout, handler=self.handler)
        except Exception as exc:  # noqa: BLE001 - retried on the next pass
            log.warning("could not delete %s: %s; retrying on the next pass", name, one_line(str(exc)))
            return False
        log.info("deleted %s (%s)", name, why)
        return True


def _pushgateway_now(date: str | None, groups: list[Any]) -> float | None:
    """The Pushgateway's current time: its answer's Date header, else the newest push time it lists
    (an underestimate: ages come out shorter, never longer); None when neither is known."""
    try:
        return parsedate_to_datetime(date).timestamp() if date else _newest_push(groups)
    except (TypeError, ValueError):
        return _newest_push(groups)


def _newest_push(groups: list[Any]) -> float | None:
    times = []
    for group in groups:
        try:
            value = float(group["push_time_seconds"]["metrics"][0]["value"])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if math.isfinite(value) and value > 0:
            times.append(value)
    return max(times, default=None)
