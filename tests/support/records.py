"""Records as the hook writes them, and what `dualtrack replay` and `report` make of them: record
lines to write, the blocks and text replay produces, the report's HTML."""
from __future__ import annotations

import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

from dualtrack.records import Reader
from dualtrack.replay import ReplayError, write_openmetrics

START = {"event": "start", "format": 2, "time": 1000.0, "job": "j", "run": "r1", "rank": 0,
         "instance": "n1", "config": {"lr": "0.1", "job": "clash"}}


def step(n: int, time: float, **extra) -> dict:
    return {"time": time, "step": n, "batch_id": n, "samples": 4, "tokens": None,
            "duration_seconds": 0.1, "data_wait_seconds": 0.02, "values": {"train/loss": 1.0 + n}, **extra}


def write(path: Path, lines: list, tail: str = "") -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines) + tail)
    return path


def dump(out: Path, metric: str) -> list[tuple[dict, str, int]]:
    """(labels, value, ms) of every sample of `metric` in the blocks under `out`."""
    (out / "wal").mkdir(exist_ok=True)
    text = subprocess.run(["promtool", "tsdb", "dump", f"--match={{__name__=\"{metric}\"}}", str(out)],
                          capture_output=True, text=True, check=True).stdout
    samples = []
    for line in text.splitlines():
        labels, value, ms = line.rsplit(" ", 2)
        pairs = (pair.split("=", 1) for pair in labels.strip("{}").split(", "))
        samples.append(({k: v.strip('"') for k, v in pairs}, value, int(ms)))
    return samples


def synthetic_record(path: Path, run: str, steps: int, spike_at: int | None = None) -> Path:
    with open(path, "w") as out:
        out.write(json.dumps({"event": "start", "format": 2, "time": 1000.0, "job": "j", "run": run, "rank": 0,
                              "instance": "n1", "config": {"lr": "0.1", "note": "<b>&</b>"}}) + "\n")
        for n in range(steps):
            loss = 1e6 if n == spike_at else 2.0 / (1 + n / 1000)
            out.write(json.dumps({"time": 1000.0 + n * 0.1, "step": n, "batch_id": n, "samples": 8, "tokens": None,
                                  "duration_seconds": 0.1, "data_wait_seconds": 0.01 * (n % 5),
                                  "values": {"loss": loss, "grad_norm": 1.0, "lr": 0.1}}) + "\n")
        out.write(json.dumps({"event": "end", "time": 1000.0 + steps * 0.1, "state": "finished",
                              "steps": steps}) + "\n")
    return path


def replayed_text(record: Path) -> str:
    """What `dualtrack replay` writes for `record` (the OpenMetrics text it turns into blocks)."""
    class Capture:
        text = ""

        def write(self, text: str, samples: int) -> None:
            self.text += text

    capture = Capture()
    write_openmetrics(Reader([record]), capture)
    return capture.text


def unescaped(value: str) -> str:
    """A label value as written in OpenMetrics text, unescaped (\\\\, \\", \\n)."""
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)


class Counter:
    """A BlockBuilder stand-in that keeps no text: counts it, and stops past `limit` bytes."""

    def __init__(self, limit: float = float("inf"), keep: int = 0) -> None:
        self.limit, self.keep = limit, keep
        self.bytes = self.samples = 0
        self.kept: list[str] = []

    def write(self, text: str, samples: int) -> None:
        self.bytes += len(text.encode())
        self.samples += samples
        if len(self.kept) < self.keep:
            self.kept.append(text)
        if self.bytes > self.limit:
            raise ReplayError(f"more than {self.limit:.0f} bytes")


#: A label and its value in OpenMetrics text.
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class _Checker(HTMLParser):
    """Tracks open elements; fails on a closing tag that does not match."""

    VOID = {"meta", "br", "img", "input", "link", "hr", "path", "use", "rect", "circle", "line", "stop"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.seen: set[str] = set()

    def handle_starttag(self, tag: str, attrs) -> None:
        self.seen.add(tag)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs) -> None:
        self.seen.add(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-3:]}"
        self.stack.pop()


def check_html(page: str) -> None:
    """Well-formed enough for any browser: doctype, balanced elements, the expected sections."""
    assert page.startswith("<!DOCTYPE html>")
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert checker.stack == [], checker.stack
    assert {"html", "head", "title", "body", "svg", "table"} <= checker.seen
