"""Real torchrun launches for the DDP tests: the ranks started on tests/support/ddp_worker.py, and
waiting for torchrun with every rank killed whatever happens."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from stack import processes
from tests.support.paths import REPO, SUPPORT
from tests.support.process import alive, descendants, kill_tree

DDP_WORKER = SUPPORT / "ddp_worker.py"


def torchrun(mode: str, folder: Path, run: str, pushgateway: str) -> subprocess.Popen:
    env = {**os.environ, "DUALTRACK_RUN": run, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "DUALTRACK_DELETE_AFTER": "none", "DUALTRACK_PUSHGATEWAY": pushgateway}
    log = open(folder / f"torchrun-{mode}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                             str(DDP_WORKER), mode, str(folder)], env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, records: Path, timeout: float = 240) -> None:
    """Wait for torchrun to succeed. Whatever happens (a failure, a hang, pytest's timeout), torchrun
    and its ranks are killed before this returns; a hang first dumps every rank's Python stacks
    into the log (distributed_worker.py: faulthandler on SIGUSR1)."""
    log = records / f"torchrun-{proc.args[-2]}.log"
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        ranks = alive(descendants(proc.pid))
        for pid in ranks:
            os.kill(pid, signal.SIGUSR1)
        try:
            processes.wait_until(lambda: log.read_text(errors="replace").count("Current thread") >= len(ranks),
                                 10, what="the ranks' stack dumps")
        except TimeoutError:
            pass  # the log shows what there is
        raise AssertionError(f"torchrun did not exit within {timeout:.0f} s; ranks {sorted(ranks)} were "
                             f"still running, their stacks:\n{log.read_text(errors='replace')[-6000:]}") from None
    finally:
        kill_tree(proc.pid)
        proc.wait()
    assert code == 0, log.read_text()[-3000:]
