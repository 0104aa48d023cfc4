"""One rank of the distributed tests, started by torchrun (gloo, CPU): `distributed_worker.py MODE DIR`.

The run id and the Pushgateway come from the environment (DUALTRACK_RUN, DUALTRACK_PUSHGATEWAY).
- ddp: Lightning DDP, 2 ranks; one callback on every rank, one with rank_zero_only=True.
- straggler: independent loops (no per-step collective); rank 1 is 3x slower; stops when DIR/stop
  exists.
- frameworks: a Hugging Face Trainer, then an Accelerate loop logging through the tracker on every
  rank (DDP, gloo); no job given: the integrations' defaults.
- hang: every step ends in an all-reduce that also carries the stop decision (DIR/stop exists on
  either rank), so a rank stopped with SIGSTOP leaves the other waiting in that collective; each rank
  writes its pid to DIR/rank<N>.pid.
- sync: DDP (3 ranks) under watch(model, optimizer), one gradient all-reduce per step after 30 ms of
  "compute"; files in DIR steer rank 1: `slow` adds 45 ms before its forward, `hang-loader` blocks its
  data iterator and `hang-compute` its compute (both until `release`); every step starts with an
  all-reduce of the stop decision (DIR/stop on any rank), so all ranks leave at the same step.
- fsdp: FSDP2 (fully_shard); logs clip_grad_norm_'s result and trainer_hook.grad_norm's next to the
  norm of the full (unsharded, all-reduced) gradients and the norm of this rank's shards alone. Then
  FSDP1 with use_orig_params=True under watch(): logs the module's clip_grad_norm_ and the same
  references (job fsdp1).
"""
from __future__ import annotations

import faulthandler
import itertools
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that times out asks for the stacks
import torch  # after the stack-dump handler, so a hang in an import shows too
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer_hook import TrainingMonitor, grad_norm

STEPS = 8


def ddp(records: Path) -> None:
    import lightning.pytorch as pl

    from trainer_hook.integrations.lightning import DualtrackCallback

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    callbacks = [DualtrackCallback(job="ddp", push_interval=0.2, record_path=records),
                 DualtrackCallback(job="ddp-rank0", push_interval=0.2, record_path=records,
                                   rank_zero_only=True)]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=8))


def frameworks(records: Path) -> None:
    import accelerate
    import transformers

    from trainer_hook.integrations.accelerate import DualtrackTracker
    from trainer_hook.integrations.huggingface import DualtrackCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16))]
    args = transformers.TrainingArguments(
        output_dir=str(records / "hf"), max_steps=STEPS, per_device_train_batch_size=4,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        ddp_timeout=60)  # the process group both parts share: a stuck collective fails within a minute
    transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=rows,
                         callbacks=[DualtrackCallback(record_path=records)]).train()  # job: "hf"

    tracker = DualtrackTracker(record_path=records)  # job: "accelerate"
    accelerator = accelerate.Accelerator(cpu=True, log_with=[tracker])
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1)), batch_size=8)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    accelerator.init_trackers("accelerate", config={"lr": 0.05})
    for step, (x, y) in enumerate(tracker.loader(data)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        tracker.log({"loss": loss.detach(), "grad_norm": norm, "samples": len(x)}, step=step)
        if step + 1 == STEPS:
            break
    tracker.finish()  # on every rank: end_training() finishes trackers on the main process only
    accelerator.wait_for_everyone()
    accelerator.end_training()
    # Then leave without running destructors. torch 2.13 can deadlock here (caught on rank 1, about
    # 1 run in 30, stacks taken with gdb): the DDP model's Reducer, freed with the GIL held, drops
    # the last reference to the destroyed gloo process group, whose destructor joins the group's
    # work thread while that thread waits for the GIL to free its last allreduce. Records are closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def straggler(records: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pause = 0.02 if rank == 0 else 0.06
    with TrainingMonitor(job="straggler", push_interval=0.5, record_path=records) as monitor:
        step = 0
        while not (records / "stop").exists():
            time.sleep(pause)  # the rank's "compute"
            monitor.log({"loss": 1.0 / (step + 1)}, step=step)
            step += 1
    dist.barrier()
    dist.destroy_process_group()


def hang(records: Path) -> None:
    # A collective waits up to 5 min: longer than the test, so no rank ends the hang by a timeout.
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank = dist.get_rank()
    (records / f"rank{rank}.pid").write_text(str(os.getpid()))
    with TrainingMonitor(job="hang", push_interval=0.5, record_path=records) as monitor:
        step = 0
        while True:
            time.sleep(0.05)  # the rank's "compute"
            stop = torch.tensor([float((records / "stop").exists())])
            dist.all_reduce(stop)  # the step's collective: both ranks leave at the same step
            if stop.item():
                break
            monitor.log({"loss": 1.0 / (step + 1)}, step=step)
            step += 1
    dist.destroy_process_group()


def sync(records: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank = dist.get_rank()
    (records / f"rank{rank}.pid").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def batches():
        torch.manual_seed(1 + rank)
        while True:
            while rank == 1 and (records / "hang-loader").exists() and not (records / "release").exists():
                time.sleep(0.05)  # a read that never returns
            yield torch.randn(8, 16), torch.randn(8, 1)

    with TrainingMonitor(job="sync", push_interval=0.5, record_path=records) as monitor:
        monitor.watch(model, optimizer)
        data = monitor.loader(batches())
        for step in itertools.count():
            stop = torch.tensor([float((records / "stop").exists())])
            dist.all_reduce(stop)
            if stop.item():
                break
            x, y = next(data)  # after the stop decision: the others then wait in the gradients' all-reduce
            time.sleep(0.03)  # the rank's "compute"
            if rank == 1 and (records / "slow").exists():
                time.sleep(0.045)
            if rank == 1 and (records / "hang-compute").exists():
                custom_kernel(records)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.log({"loss": loss.detach()}, step=step)
    dist.destroy_process_group()


def custom_kernel(records: Path) -> None:
    """Rank 1's compute, stuck until DIR/release exists."""
    while not (records / "release").exists():
        time.sleep(0.05)


def fsdp(records: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    full = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    full.load_state_dict(model.state_dict())
    fully_shard(model)
    torch.manual_seed(1 + rank)  # each rank its own data
    with TrainingMonitor(job="fsdp", push_interval=0.5, record_path=records) as monitor:
        for step in range(3):
            x, y = torch.randn(8, 16), torch.randn(8, 1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            fused = grad_norm(model.parameters())  # DTensor gradients: reduced over the mesh
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # global under FSDP
            shard = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad.to_local()) for p in model.parameters()]))
            torch.nn.functional.mse_loss(full(x), y).backward()
            for p in full.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            reference = torch.nn.utils.clip_grad_norm_(full.parameters(), 1e6)
            monitor.log({"grad_norm": norm, "fused_grad_norm": fused,  # DTensors, read as they are
                         "shard_grad_norm": shard,
                         "full_grad_norm": reference}, step=step)
            model.zero_grad()
            full.zero_grad()
    fsdp1(records, rank)
    dist.destroy_process_group()


def fsdp1(records: Path, rank: int) -> None:
    """FSDP1, use_orig_params=True: each parameter's gradient is a view of this rank's shard."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                                         torch.nn.Linear(64, 1)),
                                     use_orig_params=True, device_id=torch.device("cpu"))
    with FullyShardedDataParallel.summon_full_params(model):
        full.load_state_dict({key.replace("_fsdp_wrapped_module.", ""): value
                              for key, value in model.state_dict().items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.SGD(full.parameters(), lr=0.05)
    torch.manual_seed(1 + rank)
    with TrainingMonitor(job="fsdp1", push_interval=0.5, record_path=records) as monitor:
        monitor.watch(model, optimizer)  # must not take this rank's shards for the total
        for step in range(3):
            x, y = torch.randn(8, 16), torch.randn(8, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            norm = model.clip_grad_norm_(1e6)  # the module's method: global
            shard = grad_norm([p for p in model.parameters() if p.grad is not None])
            torch.nn.functional.mse_loss(full(x), y).backward()
            for p in full.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            reference = torch.nn.utils.clip_grad_norm_(full.parameters(), 1e6)
            optimizer.step()
            reference_optimizer.step()
            monitor.log({"loss": loss.detach(), "clip_grad_norm": norm, "shard_grad_norm": shard,
                         "full_grad_norm": reference}, step=step)
            optimizer.zero_grad()
            reference_optimizer.zero_grad()


if __name__ == "__main__":
    {"ddp": ddp, "frameworks": frameworks, "straggler": straggler, "hang": hang,
     "sync": sync, "fsdp": fsdp}[sys.argv[1]](Path(sys.argv[2]))
