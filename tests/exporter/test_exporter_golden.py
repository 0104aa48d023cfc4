"""Golden exposition files and `promtool check metrics` on the real output.

Regenerate after an intended change with DUALTRACK_UPDATE_GOLDEN=1 and review the diff.
"""
from __future__ import annotations

import os
import re

import requests

from stack import processes
from tests.support.daemons import promtool_check
from tests.support.exporter import GOLDEN, Rig, normalise

UPDATE = os.environ.get("DUALTRACK_UPDATE_GOLDEN") == "1"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"exposition differs from {path}; rerun with DUALTRACK_UPDATE_GOLDEN=1 to update"


def test_simulated_healthy_exposition_matches_golden_file(tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "comm").write_text("python3\n")
    rig = Rig("healthy", gpus=2, proc_root=str(tmp_path), pid=4242)
    for _ in range(6):
        rig.step()
    text = rig.exposition()
    # Only the real time spent in each collector and the interpreter versions are volatile.
    text = re.sub(r"(nvml_exporter_collector_duration_seconds\{[^}]*\}) \S+", r"\1 <duration>", text)
    text = re.sub(r'(pynvml_version|python_version)="[^"]*"', r'\1="*"', text)
    check_golden("simulated_healthy.prom", text)
    promtool_check(rig.exposition())


def test_daemon_output_passes_promtool_and_matches_golden_structure(tmp_path, start_service):
    exporter = start_service(processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=2",
                                                           "--sample-interval=0.1"]))
    # both GPUs: each is sampled by its own thread; GPM's second sample (5 s in) gives its first ratios
    processes.wait_until(lambda: requests.get(exporter.url + "/metrics").text.count("nvml_gpu_sm_active_ratio{") == 2,
                         timeout=15, what="GPM metrics of both GPUs after two GPM samples")
    text = requests.get(exporter.url + "/metrics", timeout=5).text
    promtool_check(text)
    ours = "\n".join(line for line in text.splitlines() if not re.match(r"^(# \w+ )?(process|python)_", line))
    check_golden("daemon_healthy_structure.txt", normalise(ours))
