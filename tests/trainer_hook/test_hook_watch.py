"""watch(): grad norm and learning rate for any optimizer, GradScaler overflows (a real fp16 run on
CPU), sharded parameters, and no device sync added on the training thread."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from stack.processes import free_port
from tests.support.hook import Fp16Run, SyncCounter, pull_monitor, pulled, record_lines, wait_pulled
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor


def monitor(tmp_path, **kwargs) -> TrainingMonitor:
    return pull_monitor(tmp_path, kwargs.pop("job", "watch"), **kwargs)


def reference_skips(steps: int) -> tuple[list[bool], list[float]]:
    """Which steps the scaler skipped, and its scale after each, read without a monitor."""
    run, skipped, scales = Fp16Run(), [], []
    for _ in range(steps):
        before = [p.detach().clone() for p in run.model.parameters()]
        run.step()
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, run.model.parameters())))
        scales.append(run.scaler.get_scale())
    return skipped, scales


@pytest.mark.parametrize("by_hand", [False, True], ids=["watched-norm", "norm-logged-by-hand"])
def test_gradscaler_overflow_is_a_skipped_step_not_a_nonfinite_one(tmp_path, by_hand):
    skipped, scales = reference_skips(30)
    assert 3 <= sum(skipped) < 30  # the run overflows now and then, and trains in between
    run = Fp16Run()
    with monitor(tmp_path) as m:
        m.watch(None if by_hand else run.model, None if by_hand else run.optimizer, scaler=run.scaler)
        for step in range(30):
            loss, norm = run.step()
            m.log({"loss": loss, "grad_norm": norm} if by_hand else {"loss": loss}, step=step)
        wait_pulled(m, "training_steps_total", lambda v: v == 30)
        assert pulled(m, "training_skipped_steps_total", reason="overflow") == sum(skipped)
        assert pulled(m, "training_nonfinite_steps_total") == 0
        assert pulled(m, "training_first_nonfinite_step") == -1
        assert pulled(m, "training_loss_scale") == scales[-1]
        assert pulled(m, "training_grad_norm_max") < 1e3  # an overflow is not a gradient explosion
        run.step(loss_factor=float("nan"))  # a NaN loss is still non-finite (and skipped)
        m.log({"loss": run.step(loss_factor=float("nan"))[0]}, step=30)
        wait_pulled(m, "training_nonfinite_steps_total", lambda v: v == 1)
        assert pulled(m, "training_first_nonfinite_step") == 30
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [x.get("skipped") == "overflow" for x in steps[:30]] == skipped
    assert [x["loss_scale"] for x in steps[:30]] == scales
    assert "nonfinite" not in steps[0] and steps[30]["nonfinite"] == ["loss"]


def test_watching_a_scaler_adds_no_device_sync_to_the_training_thread(tmp_path):
    def syncs(with_monitor: bool) -> int:
        run, counter = Fp16Run(), SyncCounter()
        with monitor(tmp_path, listen_port=None) as m:
            if with_monitor:
                m.watch(run.model, run.optimizer, scaler=run.scaler)
            with counter:
                for step in range(10):
                    loss, _ = run.step()
                    if with_monitor:
                        m.log({"loss": loss}, step=torch.tensor(step))
        return counter.syncs

    assert syncs(True) == syncs(False) > 0  # only the scaler's own read of its inf check


#: Optimizers as users pick them: unfused ones, which GradScaler does not call on an overflow, and
#: fused ones (`_step_supports_amp_scaling`), which it always calls and which skip inside.
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "adam-fused": lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
    "sgd-fused": lambda params: torch.optim.SGD(params, lr=0.01, fused=True),
    "adagrad-fused": lambda params: torch.optim.Adagrad(params, lr=0.01, fused=True),
}


class ScaledRun:
    """fp16 autocast on CPU with a GradScaler that starts far too high (it overflows, backs off,
    grows every 3 steps and overflows again), stepping `optimizer`; `unscale` calls unscale_()
    before the step, as loops that clip do."""

    def __init__(self, optimizer: str, unscale: bool = False, device: str = "cpu") -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                         torch.nn.Linear(32, 1)).to(device)
        self.optimizer = OPTIMIZERS[optimizer](self.model.parameters())
        self.scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 22, growth_interval=3)
        self.unscale, self.device = unscale, device
        self.x, self.y = torch.randn(32, 16, device=device), torch.randn(32, 1, device=device)

    def step(self, inf_grad: bool = False) -> tuple[torch.Tensor, bool, float]:
        """One step: (the loss, whether the scaler skipped it, the true unscaled grad norm);
        `inf_grad` puts an inf into one gradient (an overflow at any scale)."""
        with torch.autocast(self.device, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(self.model(self.x).float(), self.y)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        if inf_grad:
            self.model[0].weight.grad[0, 0] = float("inf")
        scale = self.scaler.get_scale()
        if self.unscale:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.model.parameters()]
        norm = torch.nn.utils.get_total_norm(grads).item() / (1.0 if self.unscale else scale)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach(), self.scaler.get_scale() < scale, norm


@pytest.mark.parametrize("optimizer, unscale, device", [
    *((name, False, "cpu") for name in OPTIMIZERS), ("adamw-fused", True, "cpu"),
    *(pytest.param(name, False, "cuda", marks=pytest.mark.gpu) for name in ("sgd", "adamw-fused"))],
    ids=[*OPTIMIZERS, "adamw-fused-unscale_", "sgd-cuda", "adamw-fused-cuda"])
def test_every_overflow_is_a_skipped_step_with_an_unscaled_grad_norm(tmp_path, optimizer, unscale, device):
    """Fused optimizers are stepped even on an overflow and skip inside: still a skipped step, never
    a non-finite one, and their grad norm is divided by the loss scale the step used."""
    run, skipped, norms = ScaledRun(optimizer, unscale, device), [], []
    with monitor(tmp_path) as m:
        m.watch(run.model, run.optimizer, scaler=run.scaler)
        for step in range(12):
            loss, was_skipped, norm = run.step(inf_grad=step == 10)
            skipped.append(was_skipped)
            norms.append(norm)
            m.log({"loss": loss}, step=step)
        wait_pulled(m, "training_steps_total", lambda v: v == 12)
        assert pulled(m, "training_skipped_steps_total", reason="overflow") == sum(skipped)
        assert pulled(m, "training_nonfinite_steps_total") == 0
        assert pulled(m, "training_nonfinite_values_total", key="grad_norm") == 0
    assert 3 <= sum(skipped) < 12 and skipped[10]  # overflows at a high scale and from an inf
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [x.get("skipped") == "overflow" for x in steps] == skipped
    assert not [x for x in steps if "nonfinite" in x]
    assert ([x["values"]["grad_norm"] for x, s in zip(steps, skipped) if not s]
            == pytest.approx([n for n, s in zip(norms, skipped) if not s], rel=1e-5))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_watching_a_scaler_adds_no_device_sync_with_a_fused_optimizer(tmp_path, device):
    def syncs(with_monitor: bool) -> int:
        run, counter = ScaledRun("adamw-fused", device=device), SyncCounter()
        with monitor(tmp_path, listen_port=None) as m:
            if with_monitor:
                m.watch(run.model, run.optimizer, scaler=run.scaler)
            for step in range(6):
                with counter:  # the scaler reads nothing for a fused optimizer
                    with torch.autocast(device, dtype=torch.float16):
                        loss = torch.nn.functional.mse_loss(run.model(run.x).float(), run.y)
                    run.optimizer.zero_grad()
                    run.scaler.scale(loss).backward()
                    run.scaler.step(run.optimizer)
                    run.scaler.update()
                    if with_monitor:
                        m.log({"loss": loss.detach()}, step=step)
        return counter.syncs

    assert syncs(True) == syncs(False)


class ScalerKwargSGD(torch.optim.SGD):
    """An optimizer of the older contract: `_step_supports_amp_scaling` and a `grad_scaler` argument
    (GradScaler hands it itself instead of `found_inf`; it decides alone whether to skip)."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        grad_scaler.unscale_(self)
        return super().step(closure)


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_an_optimizer_that_skips_without_telling_is_named_once(tmp_path, caplog):
    """Not a disabled scaler (`enabled=False`), which hands a fused optimizer nothing to tell."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    for optimizer, enabled in ((torch.optim.AdamW(model.parameters(), fused=True), False),
                               (ScalerKwargSGD(model.parameters(), lr=0.01), True)):
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        with monitor(tmp_path, listen_port=None) as m:
            m.watch(model, optimizer, scaler=scaler)
            for step in range(3):
                optimizer.zero_grad()
                scaler.scale(model(torch.randn(2, 4)).sum()).backward()
                scaler.step(optimizer)
                scaler.update()
                m.log({"loss": 1.0}, step=step)
        assert caplog.text.count("skips overflowing steps") == enabled
    assert caplog.text.count("ScalerKwargSGD skips overflowing steps inside its step without telling") == 1
    assert len(record_lines(tmp_path / "record.jsonl")[0]) == 6


class PlainSGD:
    """An optimizer that is not a torch.optim.Optimizer (like DeepSpeed's): param_groups and step()."""

    def __init__(self, params, lr: float) -> None:
        self.param_groups = [{"params": list(params), "lr": lr}]

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_watch_accepts_any_optimizer_with_param_groups(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = PlainSGD(model.parameters(), lr=0.05)
    expected = []
    with monitor(tmp_path, listen_port=None) as m:
        m.watch(model, optimizer)
        for step in range(3):
            model.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            expected.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
            optimizer.step()
            m.log({"loss": 1.0}, step=step)
    assert "step" not in vars(optimizer)  # close() restored the optimizer's own step
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [x["values"]["grad_norm"] for x in steps] == pytest.approx(expected, rel=1e-5)
    assert all(x["values"]["learning_rate"] == 0.05 for x in steps)
    with pytest.raises(ValueError, match="param_groups"):
        m.watch(model, object())


SHARDED_SCRIPT = """
import logging, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.tensor import Shard, distribute_tensor
from trainer_hook import TrainingMonitor
logging.basicConfig()
rank, port, record_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
optimizer = torch.optim.SGD([weight], lr=0.1)
with TrainingMonitor(job="sharded", run="r", pushgateway=False, record_path=record_dir) as monitor:
    monitor.watch(None, optimizer)
    for step in range(2):
        weight.grad = distribute_tensor(torch.full((4, 3), 2.0), mesh, [Shard(0)])
        optimizer.step()
        monitor.log({"loss": 1.0}, step=step)
    monitor.log({"loss": 1.0, "grad_norm": 7.0}, step=2)  # the framework's global norm, by hand
for strategy in ("NO_SHARD", "FULL_SHARD"):  # FSDP1: each rank holds all of the first's gradients
    for orig in (False, True):
        torch.manual_seed(0)
        model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)),
                     sharding_strategy=ShardingStrategy[strategy], use_orig_params=orig,
                     device_id=torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with TrainingMonitor(job="fsdp", run=f"{strategy}-{orig}", pushgateway=False,
                             record_path=record_dir) as monitor:
            monitor.watch(model, optimizer)
            model(torch.full((2, 4), rank + 1.0)).sum().backward()
            local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            optimizer.step()
            monitor.log({"loss": 1.0, "local_grad_norm": local}, step=0)
dist.destroy_process_group()
"""


def test_sharded_parameters_warn_once_instead_of_exporting_a_shards_norm(tmp_path):
    """DTensor shards and FSDP1 shards warn and export no norm; FSDP1 NO_SHARD exports it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", SHARDED_SCRIPT, str(rank), port, str(tmp_path)],
                              cwd=REPO, env=env, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for rank, stderr in enumerate(outputs):
        assert stderr.count("not the total") == 3, stderr  # the DTensors, FULL_SHARD twice
        steps, _ = record_lines(tmp_path / f"sharded-r-rank{rank}.jsonl")
        assert [x["values"].get("grad_norm") for x in steps] == [None, None, 7.0]
        assert steps[0]["values"]["learning_rate"] == pytest.approx(0.1)
        for orig in (False, True):  # NO_SHARD: whole gradients, so their norm is the total
            (step,), _ = record_lines(tmp_path / f"fsdp-NO_SHARD-{orig}-rank{rank}.jsonl")
            assert step["values"]["grad_norm"] == pytest.approx(step["values"]["local_grad_norm"], rel=1e-6)
            (step,), _ = record_lines(tmp_path / f"fsdp-FULL_SHARD-{orig}-rank{rank}.jsonl")
            assert "grad_norm" not in step["values"]
