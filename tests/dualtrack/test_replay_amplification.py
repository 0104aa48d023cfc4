"""`dualtrack replay` on a record crafted to amplify: its output grows linearly with the record,
its labels keep the hook's caps, and a total bound stops it with one line.

`python -m tests.dualtrack.test_replay_amplification` prints the figures (record bytes, output bytes, ratio).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from dualtrack.cli import main
from dualtrack.records import Reader
from dualtrack.replay import write_openmetrics
from tests.support.records import LABEL, Counter, unescaped
from trainer_hook.contract import MAX_CONFIG_LABELS, MAX_KEYS, MAX_LABEL_LENGTH

#: Output bytes per record byte that the crafted record below stays under: ~120 now (tiny step lines
#: 15 s apart, each paying for its share of slow series; 256-character labels). A hook-written record
#: makes ~12. Before the caps and the per-key streaming it grew with the square of the steps: 7,900
#: per byte for a 178 kB version of it, 70,000 for 288 kB.
RATIO = 200


def crafted(path: Path, steps: int = 12_000, keys: int = MAX_KEYS + 200) -> Path:
    """A record of long identity labels, a large config, more keys than MAX_KEYS (each logged once,
    with a long name), then many small steps 15 s apart (each one refreshes the slow series)."""
    start = time.time() - (keys + steps) * 15 - 600
    head = {"event": "start", "format": 2, "time": start, "job": "j" * 4000, "run": "r" * 4000,
            "rank": "9" * 4000, "instance": "i" * 4000,
            "config": {f"c{n}": "v" * 400 for n in range(MAX_CONFIG_LABELS + 50)}}
    with path.open("w") as handle:
        handle.write(json.dumps(head) + "\n")
        for n in range(keys + steps):
            values = {f"k{n}_" + "x" * 200: 1.0} if n < keys else {}
            handle.write(json.dumps({"step": n, "time": start + 15 * (n + 1), "values": values},
                                    separators=(",", ":")) + "\n")
    return path


def test_a_crafted_record_replays_to_output_linear_in_its_size_with_capped_labels(tmp_path: Path) -> None:
    record = crafted(tmp_path / "crafted.jsonl")
    size = record.stat().st_size
    assert 1 << 20 < size < 2 << 20
    counter = Counter(limit=RATIO * size, keep=MAX_KEYS + 10)
    runs = write_openmetrics(Reader([record]), counter)  # raises past the ratio
    assert counter.bytes <= RATIO * size and runs[0][0].steps > 12_000
    keys, longest = set(), 0
    for text in counter.kept:
        for name, value in LABEL.findall(text):
            longest = max(longest, len(unescaped(value)))
            if name == "key":
                keys.add(value)
    assert longest == MAX_LABEL_LENGTH  # the identity labels, cut as the hook cuts them
    assert len(keys) == MAX_KEYS  # the keys past the cap are not exported


def test_the_live_hook_applies_the_same_caps(tmp_path: Path) -> None:
    """One rule: the hook cuts job and instance like run, drops over-long keys, exports MAX_KEYS keys."""
    from tests.support.hook import pull_monitor, pulled, wait_pulled

    with pull_monitor(tmp_path, "j" * 4000, instance="i" * 4000) as monitor:
        assert len(monitor.settings.job) == len(monitor.settings.instance) == MAX_LABEL_LENGTH
        monitor.log({f"k{n}": 1.0 for n in range(MAX_KEYS + 5)} | {"x" * 300: 1.0}, step=0)
        wait_pulled(monitor, "training_dropped_values_total", lambda v: v == 5, reason="too_many_keys")
        assert pulled(monitor, "training_dropped_values_total", reason="invalid_key") == 1
        assert pulled(monitor, f"training_k{MAX_KEYS - 1}") == 1.0 and pulled(monitor, f"training_k{MAX_KEYS}") is None


def test_the_output_bound_stops_a_replay_with_one_line_naming_it(tmp_path: Path, capsys) -> None:
    record = crafted(tmp_path / "crafted.jsonl", steps=200, keys=10)
    out = tmp_path / "out"
    assert main(["replay", str(record), "--out", str(out), "--max-output-bytes", "100000"]) == 1
    err = capsys.readouterr().err
    assert err == ("dualtrack replay: error: the replay would write more than --max-output-bytes 100000 "
                   "bytes of OpenMetrics text: raise the bound, or replay fewer records at once\n")
    assert [p.name for p in out.iterdir()] == []  # nothing left behind
    with pytest.raises(SystemExit) as exited:
        main(["replay", str(record), "--out", str(out), "--max-output-bytes", "0"])
    assert exited.value.code == 2
    assert "not a positive number of bytes: '0'" in capsys.readouterr().err


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        path = crafted(Path(folder) / "crafted.jsonl", *(int(a) for a in sys.argv[1:3]))
        counter = Counter()
        write_openmetrics(Reader([path]), counter)
        size = path.stat().st_size
        print(f"record {size} bytes -> {counter.bytes} bytes of OpenMetrics text, {counter.samples} samples "
              f"({counter.bytes / size:.1f} per record byte)")
