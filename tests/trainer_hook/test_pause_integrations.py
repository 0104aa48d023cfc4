"""The framework integrations enter monitor.paused() around the framework's own evaluations and saves:
real Lightning and Hugging Face Trainers on CPU; the record's pause lines say what paused."""
from __future__ import annotations

import pytest

from tests.support.hook import record_lines

torch = pytest.importorskip("torch")


def pauses(folder) -> list[str]:
    """The reasons of the pause lines of the one record in `folder`."""
    paths = sorted(folder.glob("*.jsonl"))
    assert len(paths) == 1, paths
    [path] = paths
    return [line["reason"] for line in record_lines(path)[1] if line["event"] == "pause"]


def test_lightning_validation_and_checkpoints_are_pauses(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from trainer_hook.integrations.lightning import DualtrackCallback

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    (tmp_path / "rec").mkdir()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1)),
                                       batch_size=8)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=6, val_check_interval=2, num_sanity_val_steps=0,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[DualtrackCallback(job="pl", pushgateway=False, record_path=tmp_path / "rec"),
                                    checkpoints])
    trainer.fit(Regression(), data, data)
    reasons = pauses(tmp_path / "rec")
    # every 2 steps ModelCheckpoint saves (trainer.save_checkpoint), then validation runs
    assert reasons == ["checkpoint", "evaluation"] * 3, reasons
    assert len(list((tmp_path / "ckpt").iterdir())) == 3


def test_hugging_face_evaluations_and_checkpoints_are_pauses(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trainer_hook.integrations.huggingface import DualtrackCallback

    (tmp_path / "rec").mkdir()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 16))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=4, per_device_train_batch_size=4,
                                          eval_strategy="steps", eval_steps=2, report_to=[], save_strategy="steps",
                                          save_steps=2, save_only_model=True,
                                          use_cpu=True, disable_tqdm=True)
    transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=rows,
                         eval_dataset=rows[:8],
                         callbacks=[DualtrackCallback(pushgateway=False, record_path=tmp_path / "rec")]).train()
    # every 2 steps the Trainer evaluates, then saves
    assert pauses(tmp_path / "rec") == ["evaluation", "checkpoint"] * 2


def test_accelerate_save_state_is_a_pause(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from trainer_hook.integrations.accelerate import DualtrackTracker

    (tmp_path / "rec").mkdir()
    tracker = DualtrackTracker(job="acc", pushgateway=False, record_path=tmp_path / "rec")
    accelerator = accelerate.Accelerator(cpu=True, log_with=[tracker])
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers("acc", config={"lr": 0.05})
    for step in range(4):
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach()}, step=step)
        if step % 2 == 1:
            accelerator.save_state(tmp_path / f"state{step}")
    accelerator.end_training()
    assert pauses(tmp_path / "rec") == ["checkpoint"] * 2
    assert (tmp_path / "state3").is_dir()
