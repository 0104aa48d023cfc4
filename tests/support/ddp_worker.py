"""One rank of a 3-rank DDP loop (gloo, CPU), started by torchrun: `ddp_worker.py MODE DIR`.

Every rank wraps a small model in DistributedDataParallel, watches it (post-reduction grad norm)
and logs every step; the run id and the Pushgateway come from the environment. It steps until
DIR/stop exists (the decision is all-reduced, so every rank leaves at the same step).
- healthy: nothing else.
- corrupt: after the all-reduce, rank 2 adds 1e-3 to one element of its gradient before every
  optimizer step (a bad memory cell): its replica drifts, its norm differs from its peers'.
- subset: rank 1 does not watch() its model (so it never compares): the others' comparisons wait for
  it off the training thread, and every rank trains on.
- pause: once DIR/pause exists, every rank enters monitor.paused("checkpoint"): rank 0 "writes a
  checkpoint" until DIR/written exists, the others wait for it in a barrier; then they go on.
"""
from __future__ import annotations

import faulthandler
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

faulthandler.register(signal.SIGUSR1, all_threads=True)
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer_hook import TrainingMonitor


def main(mode: str, folder: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)  # each rank its own data
    paused = False
    with TrainingMonitor(job=f"ddp-{mode}", push_interval=0.5, record_path=folder) as monitor:
        if not (mode == "subset" and rank == 1):
            monitor.watch(model, optimizer)
        step = 0
        while True:
            x, y = torch.randn(8, 16), torch.randn(8, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            if mode == "corrupt" and rank == 2:
                with torch.no_grad():
                    model.module[0].weight.grad[0, 0] += 1e-3
            optimizer.step()
            optimizer.zero_grad()
            monitor.log({"loss": loss.detach()}, step=step)
            step += 1
            time.sleep(0.02)
            flags = torch.tensor([float((folder / "stop").exists()), float((folder / "pause").exists())])
            dist.all_reduce(flags)
            if flags[0]:
                break
            if mode == "pause" and flags[1] and not paused:
                paused = True
                with monitor.paused("checkpoint"):
                    if rank == 0:
                        (folder / "writing").touch()
                        while not (folder / "written").exists():
                            time.sleep(0.05)
                    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
