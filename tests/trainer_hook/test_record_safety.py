"""The local record where others may plant links or own the folder: nothing is written through a
link, nothing is written into a folder others control, records are 0600, and secrets in the logged
config are masked (the hook's own config, Lightning hparams, the Accelerate config)."""
from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from tests.support.hook import record_lines
from trainer_hook import TrainingMonitor
from trainer_hook.contract import MASK, config_labels, is_secret
from trainer_hook.record import Record

CHECKPOINT = b"precious weights\n"
START = {"event": "start", "job": "j", "run": "r", "rank": 0, "time": 1.0, "config": {"lr": "0.1"}}


def planted(tmp_path: Path) -> Path:
    """Someone else's file (a stand-in checkpoint) that a planted link points to."""
    victim = tmp_path / "elsewhere" / "model.ckpt"
    victim.parent.mkdir()
    victim.write_bytes(CHECKPOINT)
    return victim


def no_record_warning(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no local record" in r.getMessage()]


def test_a_new_record_is_0600_in_a_new_0700_folder(tmp_path: Path) -> None:
    folder = tmp_path / "records"
    with TrainingMonitor(job="j", run="r", rank=0, pushgateway=False, record_path=folder / "r.jsonl") as monitor:
        monitor.log({"loss": 1.0}, step=0)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "r.jsonl").stat().st_mode) == 0o600


def test_a_planted_record_link_is_not_followed_and_training_continues(tmp_path: Path, caplog) -> None:
    victim = planted(tmp_path)
    folder = tmp_path / "records"
    folder.mkdir(mode=0o700)
    (folder / "j-r-rank0.jsonl").symlink_to(victim)
    caplog.set_level(logging.WARNING, logger="trainer_hook")
    with TrainingMonitor(job="j", run="r", rank=0, pushgateway=False, record_path=folder) as monitor:
        for step in range(3):
            monitor.log({"loss": 1.0}, step=step)
    assert victim.read_bytes() == CHECKPOINT  # before: its last line cut, a start line appended
    warnings = no_record_warning(caplog)
    assert len(warnings) == 1 and "symbolic link" in warnings[0] and "\n" not in warnings[0]
    assert monitor.record.failures == 1  # counted in training_record_failures_total


def test_rotation_never_writes_through_a_planted_temporary_link(tmp_path: Path) -> None:
    victim = planted(tmp_path)
    path = tmp_path / "a.jsonl"
    (tmp_path / "a.jsonl.tmp").symlink_to(victim)
    record = Record(path, max_bytes=4096)
    record.write([START])
    record.write([{"time": 1.0 + i, "step": i, "values": {"loss": 0.5}, "pad": "x" * 200} for i in range(60)])
    record.close()
    assert victim.read_bytes() == CHECKPOINT  # before: overwritten by the continued start line
    assert (tmp_path / "a.jsonl.tmp").is_symlink()  # not ours: left alone
    assert (tmp_path / "a.2.jsonl").is_file() and record.failures == 0
    for part in tmp_path.glob("a*.jsonl"):
        assert stat.S_IMODE(part.stat().st_mode) == 0o600 and json.loads(part.read_text().splitlines()[0])["job"] == "j"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.parametrize("whose", ["folder", "file"])
def test_a_folder_or_file_of_another_user_gets_no_record(tmp_path: Path, caplog, whose: str) -> None:
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    path = folder / "r.jsonl"
    path.write_text(json.dumps(START) + "\n")
    os.chown(folder if whose == "folder" else path, 65534, 65534)  # nobody
    before = path.read_bytes()
    caplog.set_level(logging.WARNING, logger="trainer_hook")
    record = Record(path)
    record.write([{"time": 2.0, "step": 0, "values": {}}])
    record.close()
    assert path.read_bytes() == before and record.failures == 1
    (warning,) = no_record_warning(caplog)
    assert "belongs to uid 65534" in warning


@pytest.mark.parametrize("mode, kept", [(0o777, False), (0o1777, True), (0o755, True)])
def test_a_folder_others_can_write_without_the_sticky_bit_gets_no_record(tmp_path: Path, caplog,
                                                                         mode: int, kept: bool) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(mode)
    caplog.set_level(logging.WARNING, logger="trainer_hook")
    record = Record(folder / "r.jsonl")
    record.write([START])
    record.close()
    assert (folder / "r.jsonl").exists() is kept
    assert bool(no_record_warning(caplog)) is not kept


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another group needs root")
@pytest.mark.parametrize("group, kept", [("private", True), ("shared", False)])
def test_a_group_writable_folder_gets_the_record_only_when_the_group_is_the_users_own(
        tmp_path: Path, caplog, group: str, kept: bool) -> None:
    """umask 002, where each user has a private group: a 775 folder is the user's alone and gets the
    record (root's group here: named after it, no other member); one whose group is shared does not."""
    folder = tmp_path / "runs"
    folder.mkdir()
    folder.chmod(0o775)
    if group == "shared":
        os.chown(folder, -1, 65534)  # nogroup
    caplog.set_level(logging.WARNING, logger="trainer_hook")
    record = Record(folder / "r.jsonl")
    record.write([START])
    record.close()
    assert (folder / "r.jsonl").exists() is kept and record.failures == (0 if kept else 1)
    warnings = no_record_warning(caplog)
    assert bool(warnings) is not kept
    assert kept or "the folder is writable by others (mode 775, not sticky)" in warnings[0]


SECRETS = {"hub_token": "hf_s3cret", "wandb": {"api_key": "k3y"}, "DB_PASSWORD": "pw", "apiKey": "ak",
           "auth": {"user": "u", "pass": "p"}, "aws_secret_access_key": "sk", "servers": [{"passwd": "x"}]}
PLAIN = {"max_grad_norm": 1.0, "max_tokens": 2048, "tokenizer": "gpt2", "num_keys": 3, "author": "me"}


def test_secret_looking_config_keys_are_masked_and_others_kept() -> None:
    labels = config_labels({**SECRETS, **PLAIN})
    assert labels == {"hub_token": MASK, "wandb_api_key": MASK, "DB_PASSWORD": MASK, "apiKey": MASK,
                      "auth": MASK, "aws_secret_access_key": MASK, "servers": '[{"passwd": "***"}]',
                      "max_grad_norm": "1.0", "max_tokens": "2048", "tokenizer": "gpt2", "num_keys": "3",
                      "author": "me"}
    assert not any(is_secret(key) for key in ("learning_rate", "max_grad_norm", "tokens_per_second"))


def assert_masked(path: Path) -> None:
    text = path.read_text()
    for secret in ("hf_s3cret", "k3y", "pw", "ak", "sk"):
        assert f'"{secret}"' not in text, secret
    assert json.loads(text.splitlines()[0])["config"]["hub_token"] == MASK


def test_the_monitors_start_line_masks_secrets(tmp_path: Path) -> None:
    with TrainingMonitor(job="j", run="r", rank=0, pushgateway=False, record_path=tmp_path / "r.jsonl",
                         config={**SECRETS, **PLAIN}) as monitor:
        monitor.log({"loss": 1.0}, step=0)
    assert_masked(tmp_path / "r.jsonl")
    assert json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])["config"]["max_grad_norm"] == "1.0"


def test_lightning_hparams_and_accelerate_config_are_masked(tmp_path: Path) -> None:
    """The real integrations: a LightningModule's saved hyper-parameters, Accelerate's init_trackers
    config."""
    lightning = pytest.importorskip("lightning")
    accelerate = pytest.importorskip("accelerate")
    import torch

    from trainer_hook.integrations.accelerate import DualtrackTracker
    from trainer_hook.integrations.lightning import DualtrackCallback

    class Tiny(lightning.LightningModule):
        def __init__(self, hub_token: str = "hf_s3cret", lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[DualtrackCallback(job="pl", run="mask", pushgateway=False,
                                                             record_path=tmp_path / "pl.jsonl")])
    trainer.fit(Tiny(), data)
    assert_masked(tmp_path / "pl.jsonl")
    assert record_lines(tmp_path / "pl.jsonl")[1][0]["config"]["lr"] == "0.1"

    tracker = DualtrackTracker(job="acc", run="mask", pushgateway=False, record_path=tmp_path / "acc.jsonl")
    accelerator = accelerate.Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("acc", config={**SECRETS, **PLAIN})
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    assert_masked(tmp_path / "acc.jsonl")
