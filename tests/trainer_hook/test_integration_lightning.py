"""The Lightning callback: real Lightning Trainers (`lightning` and `pytorch_lightning`) on CPU."""
from __future__ import annotations

import importlib

import pytest

pytest.importorskip("lightning")
import torch

from stack import processes
from tests.support.hook import SyncCounter, record_lines, run_id
from tests.support.integration import final_pushed, slow_loader
from trainer_hook.integrations.lightning import DualtrackCallback

BATCH, ACCUMULATE, STEPS, NAN_BATCH, LOAD_DELAY = 8, 2, 5, 9, 0.02  # NaN in the last batch


def module_class(package: str) -> type:
    pl = importlib.import_module(package)

    class Regression(pl.LightningModule):
        """A linear model; records its own batch losses and total grad norms to check against."""

        def __init__(self, lr: float = 0.05, width: int = 16) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(width, 1)
            self.losses, self.norms = [], []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.norms.append(pl.utilities.grad_norm(self, 2)["grad_2.0_norm_total"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    return Regression


def loader(load_delay: float = 0.0, nan_batch: int | None = None):
    torch.manual_seed(0)
    x, y = torch.randn(BATCH * ACCUMULATE * STEPS, 16), torch.randn(BATCH * ACCUMULATE * STEPS, 1)
    if nan_batch is not None:
        x[nan_batch * BATCH] = float("nan")
    return slow_loader(x, y, BATCH, load_delay)


def fit(package: str, callbacks: list, clip: float | None = 0.5, **data) -> object:
    pl = importlib.import_module(package)
    model = module_class(package)()
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, accumulate_grad_batches=ACCUMULATE,
                         gradient_clip_val=clip, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, loader(**data))
    return model


@pytest.mark.e2e
def test_lightning_steps_reach_the_pushgateway(tmp_path, start_service):
    pgw = start_service(processes.pushgateway(tmp_path))
    run = run_id("pl")
    callback = DualtrackCallback(job="pl-test", run=run, pushgateway=pgw.url, push_interval=0.2,
                                 record_path=tmp_path / "r.jsonl")
    model = fit("lightning.pytorch", [callback], load_delay=LOAD_DELAY, nan_batch=NAN_BATCH)

    pushed = final_pushed(pgw.url, run, "training_steps_total", "training_samples_total",
                          "training_last_nonfinite_step", "training_data_wait_seconds_total")
    assert pushed["training_steps_total"] == STEPS
    assert pushed["training_samples_total"] == STEPS * ACCUMULATE * BATCH
    assert pushed["training_last_nonfinite_step"] == NAN_BATCH // ACCUMULATE + 1
    # One batch is prefetched before the loop starts its clock.
    assert pushed["training_data_wait_seconds_total"] >= (STEPS * ACCUMULATE - 1) * LOAD_DELAY
    assert final_pushed(pgw.url, run, "training_run_info", lr="0.05", width="16",
                        accumulate_grad_batches="2", gradient_clip_val="0.5")["training_run_info"]

    steps, events = record_lines(tmp_path / "r.jsonl")
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    for line, norm, pair in zip(steps, model.norms, zip(model.losses[::2], model.losses[1::2])):
        mean = (pair[0] + pair[1]) / 2
        if torch.isfinite(mean):
            assert line["values"]["loss"] == pytest.approx(float(mean), rel=1e-5)
            assert line["values"]["grad_norm"] == pytest.approx(float(norm), rel=1e-5)  # before clipping
            assert line["values"]["learning_rate"] == 0.05
        else:
            assert line["values"]["loss"] == "nan" and "loss" in line["nonfinite"]
    assert events[-1]["state"] == "finished"


def test_pytorch_lightning_import_name_without_clipping_and_no_device_sync(tmp_path):
    """No clipping: the grad norm is the callback's own fused read; it adds no device sync."""
    pytest.importorskip("pytorch_lightning")
    counts = []
    for callbacks in ([], [DualtrackCallback(job="pl-test", run="sync", pushgateway=False,
                                             record_path=tmp_path / "r.jsonl")]):
        with SyncCounter() as syncs:
            model = fit("pytorch_lightning", callbacks, clip=None)
        counts.append(syncs.syncs)
    assert counts[1] == counts[0]
    steps, events = record_lines(tmp_path / "r.jsonl")
    assert [line["values"]["grad_norm"] for line in steps] == pytest.approx(
        [float(norm) for norm in model.norms], rel=1e-5)
    # Each step names its batch: the epoch and the batch_idx of the first of its accumulated batches.
    assert [line["batch_id"] for line in steps] == [
        {"epoch": 0, "batch_idx": ACCUMULATE * step} for step in range(STEPS)]
    assert events[-1]["state"] == "finished"


class ScaledRegression(module_class("lightning.pytorch")):
    """The regression in "16-mixed": notes, before each optimizer step, the scale and the true
    (unscaled) grad norm; after it, whether the scaler skipped it (its scale dropped)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused, self.skipped, self.scale = fused, [], 0.0

    def configure_optimizers(self):
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_before_optimizer_step(self, optimizer):
        self.scale = self.trainer.precision_plugin.scaler.get_scale()
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]).item()
        self.norms.append(norm / self.scale if self.fused else norm)  # Lightning unscaled the unfused

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.skipped.append(self.trainer.precision_plugin.scaler.get_scale() < self.scale)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "adamw-fused"])
def test_fp16_overflows_are_skipped_steps_with_an_unscaled_grad_norm(tmp_path, fused):
    """precision="16-mixed" as on a GPU (Lightning's own MixedPrecision plugin, given a CPU
    GradScaler: Lightning turns "16-mixed" on a CPU into bf16): every overflow is a skipped step,
    never a non-finite one; a fused optimizer's norm, still scaled before its step, is unscaled."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    callback = DualtrackCallback(job="pl-test", run="fp16", pushgateway=False,
                                 record_path=tmp_path / "r.jsonl")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22, growth_interval=2)
    model = ScaledRegression(fused)
    trainer = pl.Trainer(accelerator="cpu", max_steps=10, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(model, loader())
    assert 2 <= sum(model.skipped) < 10
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert [line.get("skipped") == "overflow" for line in steps] == model.skipped
    assert not [line for line in steps if "nonfinite" in line]
    assert ([line["values"]["grad_norm"] for line, s in zip(steps, model.skipped) if not s]
            == pytest.approx([n for n, s in zip(model.norms, model.skipped) if not s], rel=1e-5))
