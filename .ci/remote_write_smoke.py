"""The hook's remote write at the remote-write extra's floors, without torch (.ci/min-versions): a run
writes to a loopback receiver (tests/support/remote_write.py decodes with the same floors) and its
steps arrive as training_step samples, in Remote-Write 1.0's headers."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ["DUALTRACK_DELETE_AFTER"] = "none"  # no final wait for a Prometheus that is not there

from tests.support.remote_write import receiver
from trainer_hook import TrainingMonitor

with tempfile.TemporaryDirectory() as scratch, receiver() as (url, got):
    monitor = TrainingMonitor(remote_write_url=url, job="smoke", run="rw-floors", pushgateway=False,
                              record_path=Path(scratch) / "record.jsonl", push_interval=0.05)
    for step in range(20):
        monitor.log({"loss": 1.0 / (step + 1)}, step=step)
    monitor.close()
    assert got, "no remote write reached the receiver"
    assert all(r.headers.get("Content-Encoding") == "snappy" for r in got)
    steps = [value for r in got for labels, samples in r.series.items()
             if dict(labels)["__name__"] == "training_step" for _, value in samples]
    assert steps and max(steps) == 19, steps
print(f"remote-write smoke test: {len(got)} writes, last step {int(max(steps))}, at the extra's floors")
