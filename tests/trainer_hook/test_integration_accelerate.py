"""The Accelerate tracker: a real Accelerator (CPU) runs a small training loop."""
from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
import accelerate
import torch

from stack import processes
from tests.support.hook import SyncCounter, record_lines, run_id
from tests.support.integration import DeepSpeedEngine, final_pushed, gpu_fp16_on_cpu, slow_loader
from trainer_hook.integrations.accelerate import DualtrackTracker

BATCH, STEPS, NAN_STEP, LOAD_DELAY = 8, 6, 5, 0.02


def train(tracker: DualtrackTracker | None, *, load_delay: float = 0.0,
          nan_step: int | None = None) -> list[torch.Tensor]:
    """The Accelerate README loop with clipping, logging every step; returns the clipped norms."""
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True, log_with=[tracker] if tracker else None)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(BATCH * STEPS, 16), torch.randn(BATCH * STEPS, 1)
    if nan_step is not None:
        x[nan_step * BATCH] = float("nan")
    data = slow_loader(x, y, BATCH, load_delay)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    accelerator.init_trackers("accelerate-test", config={"lr": 0.05, "batch_size": BATCH})
    norms = []
    for step, (inputs, targets) in enumerate(tracker.loader(data) if tracker else data):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach(), "lr": 0.05, "epoch": 0, "samples": len(inputs)},
                        step=step)
    accelerator.end_training()
    return norms


@pytest.mark.e2e
def test_tracker_steps_reach_the_pushgateway(tmp_path, start_service):
    pgw = start_service(processes.pushgateway(tmp_path))
    run = run_id("acc")
    tracker = DualtrackTracker(job="acc-test", run=run, pushgateway=pgw.url, push_interval=0.2,
                               record_path=tmp_path / "r.jsonl")
    norms = train(tracker, load_delay=LOAD_DELAY, nan_step=NAN_STEP)

    pushed = final_pushed(pgw.url, run, "training_steps_total", "training_samples_total",
                          "training_last_nonfinite_step", "training_data_wait_seconds_total",
                          "training_learning_rate")
    assert pushed["training_steps_total"] == STEPS
    assert pushed["training_samples_total"] == STEPS * BATCH
    assert pushed["training_last_nonfinite_step"] == NAN_STEP
    assert pushed["training_data_wait_seconds_total"] >= STEPS * LOAD_DELAY
    assert pushed["training_learning_rate"] == 0.05  # logged as "lr"
    assert final_pushed(pgw.url, run, "training_run_info", lr="0.05", batch_size="8")["training_run_info"]

    steps, events = record_lines(tmp_path / "r.jsonl")
    assert [line["step"] for line in steps] == list(range(STEPS))
    for line, norm in zip(steps[:NAN_STEP], norms):  # clip_grad_norm_'s own (pre-clip) figures
        assert line["values"]["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    assert set(steps[NAN_STEP]["nonfinite"]) == {"loss", "grad_norm"}
    assert events[0]["rank"] == 0 and events[-1]["state"] == "finished"


def test_tracker_adds_no_device_sync(tmp_path):
    counts = []
    for tracker in (None, DualtrackTracker(job="acc-test", run="sync", pushgateway=False,
                                           record_path=tmp_path / "r.jsonl")):
        with SyncCounter() as syncs:
            train(tracker)
        counts.append(syncs.syncs)
    assert counts[1] == counts[0]
    assert len(record_lines(tmp_path / "r.jsonl")[0]) == STEPS


def test_under_deepspeed_the_grad_norm_is_the_engines_global_one(tmp_path):
    """DeepSpeed clips inside its own step, so the loop need not call clip_grad_norm_ (and under
    ZeRO no rank holds the whole gradients): the tracker reports the engine's global norm."""
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    tracker = DualtrackTracker(job="acc-test", run=run_id("acc-ds"), pushgateway=False,
                               record_path=tmp_path / "r.jsonl")
    engine = DeepSpeedEngine()
    accelerator = accelerate.Accelerator(cpu=True, log_with=[tracker])
    accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)  # what prepare() sets
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers("accelerate-test")
    for step in range(3):
        loss = torch.nn.functional.mse_loss(model(torch.randn(BATCH, 16)), torch.randn(BATCH, 1))
        accelerator.backward(loss)
        engine.zero_step(model.parameters())  # under DeepSpeed, part of accelerator.backward
        accelerator.log({"loss": loss.detach()}, step=step)
    accelerator.end_training()
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert [line["values"].get("grad_norm") for line in steps] == pytest.approx(engine.norms, rel=1e-6)


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one AcceleratorState per process, and an fp16 one cannot follow an fp32 one:
    reset it around the test (as the Trainer does when it starts)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "adamw-fused"])
def test_fp16_overflows_are_skipped_steps_not_nonfinite_ones(tmp_path, fused, fresh_accelerator_state):
    """Accelerate's GradScaler skips the overflowing steps; a fused optimizer is stepped anyway and
    skips inside (where accelerate's own optimizer_step_was_skipped says False): the tracker counts
    every skip from the scaler's found_inf, and the inf grad norm of a skipped step is no fault."""
    tracker = DualtrackTracker(job="acc-test", run=run_id("acc-fp16"), pushgateway=False,
                               record_path=tmp_path / "r.jsonl")
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16", log_with=[tracker])
    scaler = gpu_fp16_on_cpu(accelerator)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused
                 else torch.optim.SGD(model.parameters(), lr=0.01))
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers("accelerate-test")
    x, y = torch.randn(BATCH, 16), torch.randn(BATCH, 1)
    skipped, norms, scales = [], [], []
    for step in range(10):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        scale = scaler.get_scale()
        optimizer.step()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
        skipped.append(scales[-1] < scale)
        accelerator.log({"loss": loss.detach()}, step=step)
    accelerator.end_training()
    assert 2 <= sum(skipped) < 10
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert [line.get("skipped") == "overflow" for line in steps] == skipped
    assert not [line for line in steps if "nonfinite" in line]
    assert [line["loss_scale"] for line in steps] == scales
    assert ([line["values"]["grad_norm"] for line, s in zip(steps, skipped) if not s]
            == pytest.approx([n for n, s in zip(norms, skipped) if not s], rel=1e-6))
