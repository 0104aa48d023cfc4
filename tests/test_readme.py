"""The README's promises, checked against what the code does: its hook snippet runs as written."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from stack import processes
from stack.processes import REPO
from tests.hook_support import pushed_value, run_id

README = REPO / "README.md"

# What the snippet leaves to the reader ("model, optimizer and train_loader are your own").
USER_CODE = """
import torch
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
train_loader = [torch.randn(256, 8) for _ in range(5)]
"""


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_hook_snippet_runs_as_written_without_a_warning(start_service, tmp_path) -> None:
    """With or without CUDA: run under `-W error`, it trains and its steps reach the Pushgateway."""
    snippet = next(block for block in python_blocks(README.read_text()) if "TrainingMonitor(job=" in block)
    pgw = start_service(processes.pushgateway(tmp_path))
    run = run_id("readme")
    script = tmp_path / "snippet.py"
    script.write_text(USER_CODE + snippet.replace("http://127.0.0.1:9091", pgw.url))
    env = {**os.environ, "PYTHONPATH": str(REPO), "DUALTRACK_RUN": run, "DUALTRACK_DELETE_AFTER": "none"}
    done = subprocess.run([sys.executable, "-W", "error", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert pushed_value(pgw.url, "training_steps_total", run, job="pretrain") == 5
