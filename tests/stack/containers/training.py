"""A training run in a container of its own, for tests/stack/test_containers.py: the hook (no torch in the
image: it takes Python numbers) pushes to the stack's Pushgateway until the container stops. Run as
the container's PID 1, in the container's own PID namespace, as a user's training would be."""
from __future__ import annotations

import signal
import sys
import time

from trainer_hook import TrainingMonitor


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # PID 1 ignores a SIGTERM it does not handle
    with TrainingMonitor(job="containers-pidns", push_interval=1, record_path=False) as monitor:
        step = 0
        while True:
            step += 1
            monitor.log({"loss": 1.0 / step}, step=step)
            time.sleep(0.2)


if __name__ == "__main__":
    main()
