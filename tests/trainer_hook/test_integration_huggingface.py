"""The Hugging Face Trainer callback: a real Trainer trains a tiny GPT-2 (built from a config) on CPU."""
from __future__ import annotations

import math
import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub here
transformers = pytest.importorskip("transformers")
import torch

from stack import processes
from tests.support.hook import SyncCounter, record_lines, run_id
from tests.support.integration import DeepSpeedEngine, final_pushed, gpu_fp16_on_cpu
from trainer_hook.integrations.huggingface import DualtrackCallback

BATCH, SEQ, STEPS, NAN_STEP, LOAD_DELAY, LOG_DELAY = 4, 16, 6, 4, 0.02, 0.1


class SlowLogging(transformers.TrainerCallback):
    """Logging (an evaluation, a checkpoint) that takes a while between two steps."""

    def on_log(self, *args, **kwargs) -> None:
        time.sleep(LOG_DELAY)


def make_trainer(tmp_path, callbacks, *, load_delay: float = 0.0, nan_step: int | None = None,
                 logging_steps: int = 1, max_grad_norm: float = 1.0, **arguments) -> transformers.Trainer:
    """A 1-layer GPT-2 trained for STEPS steps; the batch of `nan_step` has no label (loss 0/0 = NaN).
    `arguments`: more TrainingArguments."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    rows = [{"input_ids": torch.randint(0, 64, (SEQ,))} for _ in range(64)]
    batches = iter(range(1, 1000))

    def collate(items):
        time.sleep(load_delay)  # a slow input pipeline
        ids = torch.stack([item["input_ids"] for item in items])
        labels = ids.clone()
        if next(batches) == nan_step:
            labels[:] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, logging_steps=logging_steps, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, max_grad_norm=max_grad_norm, **arguments)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                train_dataset=rows, data_collator=collate, callbacks=callbacks)


@pytest.mark.e2e
def test_trainer_steps_reach_the_pushgateway_with_the_raw_nan_loss(tmp_path, start_service):
    pgw = start_service(processes.pushgateway(tmp_path))
    run = run_id("hf")
    callback = DualtrackCallback(job="hf-test", run=run, pushgateway=pgw.url, push_interval=0.2,
                                 record_path=tmp_path / "r.jsonl", config={"dataset": "random"})
    trainer = make_trainer(tmp_path, [SlowLogging(), callback], load_delay=LOAD_DELAY, nan_step=NAN_STEP)
    trainer.train()

    pushed = final_pushed(pgw.url, run, "training_steps_total", "training_samples_total",
                          "training_tokens_total", "training_last_nonfinite_step", "training_epoch",
                          "training_data_wait_seconds_total")
    assert pushed["training_steps_total"] == STEPS
    assert pushed["training_samples_total"] == STEPS * BATCH
    assert pushed["training_tokens_total"] == STEPS * BATCH * SEQ
    assert pushed["training_last_nonfinite_step"] == NAN_STEP
    assert pushed["training_epoch"] == pytest.approx(trainer.state.epoch)
    # Every batch took LOAD_DELAY to load; the logging after each step (LOG_DELAY) is not waiting.
    assert STEPS * LOAD_DELAY <= pushed["training_data_wait_seconds_total"] < STEPS * (LOAD_DELAY + LOG_DELAY / 2)
    assert final_pushed(pgw.url, run, "training_run_info", model_type="gpt2", learning_rate="0.001",
                        gradient_accumulation_steps="1", dataset="random")["training_run_info"]

    # Step by step, the record holds the Trainer's own figures, except the NaN it hides.
    steps, events = record_lines(tmp_path / "r.jsonl")
    history = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1)) == sorted(history)
    for line in steps:
        logged, ours = history[line["step"]], line["values"]
        assert ours["grad_norm"] == pytest.approx(logged["grad_norm"], rel=1e-6)
        # The rate the step used (linear decay from 1e-3; some versions log the next step's).
        assert ours["learning_rate"] == pytest.approx(1e-3 * (1 - (line["step"] - 1) / STEPS))
        if line["step"] == NAN_STEP:
            assert math.isfinite(logged["loss"])  # logging_nan_inf_filter replaced it
            assert ours["loss"] == "nan" and line["nonfinite"] == ["loss"]
        else:
            assert ours["loss"] == pytest.approx(logged["loss"], abs=1e-4)  # older versions round
    assert events[0]["rank"] == 0 and events[-1]["state"] == "finished"


def test_the_callback_adds_no_device_sync_and_serves_a_second_train(tmp_path):
    """The Trainer reads the loss for its NaN filter each step; the callback reads nothing more."""
    callback = DualtrackCallback(job="hf-test", run=run_id("hf-sync"), pushgateway=False,
                                 record_path=tmp_path / "r.jsonl")
    counts = []
    for callbacks in ([], [callback]):
        trainer = make_trainer(tmp_path, callbacks, logging_steps=1000)
        with SyncCounter() as syncs:
            trainer.train()
        counts.append(syncs.syncs)
    assert counts[0] >= STEPS  # the counter sees the Trainer's own reads
    assert counts[1] == counts[0]
    make_trainer(tmp_path, [callback], logging_steps=1000).train()  # the same callback again
    steps, events = record_lines(tmp_path / "r.jsonl")
    assert len(steps) == 2 * STEPS
    # Each step names its batch: the Trainer's step and its first sample (a second train restarts).
    assert [line["batch_id"] for line in steps] == 2 * [
        {"step": step, "sample": (step - 1) * BATCH} for step in range(1, STEPS + 1)]
    assert [event["event"] for event in events] == ["start", "end", "start", "end"]


class ZeroStep(transformers.TrainerCallback):
    """The Trainer under DeepSpeed ZeRO-2/3, on one CPU process: the engine's step has consumed the
    gradients (no `p.grad` left) before the optimizer step, and accelerate's `clip_grad_norm_`
    returns None, as it does under DeepSpeed in the versions of transformers#37566."""

    def __init__(self, trainer: transformers.Trainer, engine: DeepSpeedEngine, with_engine: bool) -> None:
        self.accelerator, self.engine, self.with_engine = trainer.accelerator, engine, with_engine
        self.accelerator.clip_grad_norm_ = lambda *args, **kwargs: None

    def on_train_begin(self, *args, **kwargs) -> None:
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

        if self.with_engine:  # as the Trainer's prepare() sets it (train() first frees the old one)
            self.accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(self.engine)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs) -> None:
        self.engine.zero_step(model.parameters())


def deepspeed_trainer(tmp_path, callback, *, with_engine: bool, max_grad_norm: float) -> DeepSpeedEngine:
    engine = DeepSpeedEngine()
    trainer = make_trainer(tmp_path, [callback], logging_steps=1000, max_grad_norm=max_grad_norm)
    trainer.add_callback(ZeroStep(trainer, engine, with_engine))
    trainer.train()
    return engine


def test_under_deepspeed_the_grad_norm_is_the_engines_global_one(tmp_path):
    callback = DualtrackCallback(job="hf-test", run=run_id("hf-ds"), pushgateway=False,
                                 record_path=tmp_path / "r.jsonl")
    engine = deepspeed_trainer(tmp_path, callback, with_engine=True, max_grad_norm=1.0)
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert len(engine.norms) == STEPS
    assert [line["values"].get("grad_norm") for line in steps] == pytest.approx(engine.norms, rel=1e-6)


def test_without_a_global_norm_zero_gradients_export_no_grad_norm_and_say_why_once(tmp_path, caplog):
    """max_grad_norm=0 and no engine norm: the callback's own read would see no gradient under
    ZeRO-2/3 and export 0.0; it exports nothing and says why, once."""
    callback = DualtrackCallback(job="hf-test", run=run_id("hf-zero"), pushgateway=False,
                                 record_path=tmp_path / "r.jsonl")
    with caplog.at_level("WARNING", logger="trainer_hook"):
        deepspeed_trainer(tmp_path, callback, with_engine=False, max_grad_norm=0.0)
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert len(steps) == STEPS and not any("grad_norm" in line["values"] for line in steps)
    warnings = [r.getMessage() for r in caplog.records if "grad_norm is not reported" in r.getMessage()]
    assert len(warnings) == 1 and "no parameter holds a gradient" in warnings[0], warnings


class ScaleDrops(transformers.TrainerCallback):
    """Which optimizer steps the GradScaler skipped: those after which its scale dropped."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler, self.skipped, self.scale = scaler, [], 0.0

    def on_pre_optimizer_step(self, *args, **kwargs) -> None:
        self.scale = self.scaler.get_scale()

    def on_optimizer_step(self, *args, **kwargs) -> None:
        self.skipped.append(self.scaler.get_scale() < self.scale)


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_fp16_overflows_are_skipped_steps_not_nonfinite_ones(tmp_path, optim):
    """fp16 on a GPU: the Trainer's GradScaler skips the steps that overflow while it calibrates its
    scale. The default fused AdamW is stepped anyway and skips inside (accelerate's own
    optimizer_step_was_skipped says False): every skip is counted, none is a non-finite step."""
    callback = DualtrackCallback(job="hf-test", run=run_id("hf-fp16"), pushgateway=False,
                                 record_path=tmp_path / "r.jsonl")
    trainer = make_trainer(tmp_path, [callback], fp16=True, optim=optim)
    drops = ScaleDrops(gpu_fp16_on_cpu(trainer.accelerator, init_scale=2.0 ** 17))
    trainer.add_callback(drops)
    trainer.train()
    assert 1 <= sum(drops.skipped) < STEPS
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert [line.get("skipped") == "overflow" for line in steps] == drops.skipped
    assert not [line for line in steps if "nonfinite" in line]
    history = {entry["step"]: entry for entry in trainer.state.log_history if "grad_norm" in entry}
    for line, skipped in zip(steps, drops.skipped):  # unscaled: the Trainer's own figure
        if not skipped:
            assert line["values"]["grad_norm"] == pytest.approx(history[line["step"]]["grad_norm"], rel=1e-6)
