"""The README's main command (`python -m stack`): the whole stack comes up, the demo run's values reach
Prometheus, and Ctrl-C stops every process it started."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stack.processes import REPO, query, wait_for_series, wait_until

pytestmark = pytest.mark.e2e


def _children(pid: int) -> set[int]:
    """PIDs whose parent is `pid` (the demo's daemons run in sessions of their own)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def test_main_command_runs_the_stack_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    demo = subprocess.Popen([sys.executable, "-m", "stack", "--phase-seconds", "30", "--workdir", str(tmp_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(demo.stdout), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("dualtrack is up" in line for line in output), 90, what="the stack to come up")
        text = "".join(output)
        assert "SIMULATED GPUs" in text, text
        prometheus = re.search(r"Prometheus\s+(http://127\.0\.0\.1:\d+)", text).group(1)
        for name in ("Alertmanager", "Pushgateway", "Exporter"):
            assert re.search(rf"{name}\s+http://127\.0\.0\.1:\d+", text), f"{name} URL not printed:\n{text}"
        daemons = _children(demo.pid)
        assert len(daemons) >= 5, "exporter, pushgateway, alertmanager, prometheus and the training run"

        # Both tracks reach Prometheus: the simulated GPUs and the demo run's steps.
        wait_for_series(prometheus, 'nvml_gpu_info{simulated="true"}', timeout=60)
        steps = wait_for_series(prometheus, 'training_step{job="demo"} > 0', timeout=60)
        assert steps[0]["metric"]["run"] == "mlp-lr1e-2"
        assert query(prometheus, 'up{job="dualtrack-exporter"} == 1')
    finally:
        demo.send_signal(signal.SIGINT)
        returncode = demo.wait(30)
        reader.join(5)
    assert returncode == 0, "".join(output)
    assert "stopping" in "".join(output)
    assert not [pid for pid in daemons if Path(f"/proc/{pid}").exists()], "a daemon outlived the main command"
