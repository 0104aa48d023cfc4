"""Hook smoke test for the minimum-versions run: log and push to a real Pushgateway without torch.

Run by .ci/min-versions in a virtual environment that holds exactly the declared minimum versions
and no torch. Exits non-zero (an AssertionError) when the pushed state is wrong or fails
`promtool check metrics`.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import requests

sys.modules["torch"] = None  # even where torch is installed: `import torch` raises ImportError

from stack import processes  # noqa: E402
from trainer_hook import TrainingMonitor  # noqa: E402


def training_families(text: str) -> str:
    """The training_* families (with their HELP/TYPE lines) of a Pushgateway exposition."""
    return "".join(line + "\n" for line in text.splitlines()
                   if line.startswith(("training_", "# HELP training_", "# TYPE training_")))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        gateway = processes.pushgateway(Path(tmp)).start()
        try:
            with TrainingMonitor(job="minversions", run="smoke", pushgateway=gateway.url, push_interval=0.2,
                                 record_path=Path(tmp) / "record.jsonl", delete_after=None) as monitor:
                for step in range(20):
                    monitor.log({"loss": 1.0 / (step + 1), "learning_rate": 0.01}, step=step, samples=8)
                processes.wait_until(
                    lambda: 'training_steps_total{instance=' in requests.get(gateway.url + "/metrics", timeout=5).text
                    and "training_step{" in requests.get(gateway.url + "/metrics", timeout=5).text,
                    timeout=20, what="the hook's first push")
            text = requests.get(gateway.url + "/metrics", timeout=5).text
            ours = training_families(text)
            assert 'job="minversions"' in ours and 'run="smoke"' in ours, ours
            assert any(line.startswith("training_samples_total{") and line.endswith(" 160")
                       for line in ours.splitlines()), ours
            check = subprocess.run(["promtool", "check", "metrics"], input=ours, capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr
        finally:
            gateway.stop()
    print("hook smoke test: pushed 20 steps without torch; promtool check metrics passed")


if __name__ == "__main__":
    main()
