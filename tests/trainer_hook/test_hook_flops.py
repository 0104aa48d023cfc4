"""Model FLOPs (training_model_flops_total, the numerator of the run's MFU): the user's figures times
the tokens or samples logged, else 6 x the parameters watch() saw x the tokens; real torch on CPU."""
from __future__ import annotations

import math

import pytest
import torch

from tests.support.hook import pull_monitor, pulled, record_lines, wait_pulled

FLOPS = "training_model_flops_total"


class TinyTransformer(torch.nn.Module):
    """A real (small) decoder block with a frozen embedding: every parameter does FLOPs."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.embed.weight.requires_grad_(False)
        self.block = torch.nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, batch_first=True)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)))


def train(monitor, steps: int, batch: int = 4, length: int = 8, watch: bool = True,
          tokens_as_tensor: bool = False, autocast: torch.dtype | None = None, scaler=None) -> int:
    """A real training loop logging tokens= (a tensor copy, read off the training thread, if asked)
    and samples=; returns the model's parameter count."""
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if watch:
        monitor.watch(model, optimizer, scaler=scaler)
    for step in range(steps):
        ids = torch.randint(0, 50, (batch, length))
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mask = torch.ones_like(ids)
        monitor.log({"loss": loss.detach()}, step=step, samples=batch,
                    tokens=mask.sum() if tokens_as_tensor else mask.numel())
    return sum(p.numel() for p in model.parameters())


def test_flops_per_token_times_the_tokens_logged(tmp_path):
    with pull_monitor(tmp_path, "flops", flops_per_token=1.5e9) as monitor:
        train(monitor, steps=7, tokens_as_tensor=True)
        # watched fp32 parameters on the CPU: the precision read is fp32
        assert wait_pulled(monitor, FLOPS, lambda v: v == 7 * 32 * 1.5e9, precision="fp32") == 7 * 32 * 1.5e9
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [line["flops"] for line in steps] == [32 * 1.5e9] * 7


def test_the_estimate_is_six_times_the_parameters_watch_saw_times_the_tokens(tmp_path):
    with pull_monitor(tmp_path, "flops-estimate", precision="tf32") as monitor:
        params = train(monitor, steps=5)
        expected = 6 * params * 5 * 32
        assert wait_pulled(monitor, FLOPS, lambda v: v == expected, precision="tf32") == expected
    assert params > 1000  # the frozen embedding counted too: its matmuls run forward and backward


def test_flops_per_sample_times_the_samples_and_the_users_figure_wins_over_the_estimate(tmp_path):
    with pull_monitor(tmp_path, "flops-sample", flops_per_sample=2e12) as monitor:
        train(monitor, steps=3)  # watched: the estimate is known, but not used
        assert wait_pulled(monitor, FLOPS, lambda v: v == 3 * 4 * 2e12) == 3 * 4 * 2e12


def test_no_figures_and_no_watch_exports_no_flops(tmp_path):
    with pull_monitor(tmp_path, "flops-none") as monitor:
        train(monitor, steps=3, watch=False)
        wait_pulled(monitor, "training_steps_total", lambda v: v == 3)
        assert pulled(monitor, FLOPS) is None
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert all("flops" not in line for line in steps)


@pytest.mark.parametrize("arguments", [{"flops_per_token": 0}, {"flops_per_token": -1.0},
                                       {"flops_per_sample": math.nan}, {"flops_per_token": math.inf},
                                       {"flops_per_token": True}, {"flops_per_sample": "many"},
                                       {"precision": "int8"}, {"precision": "BF16"}])
def test_bad_flops_settings_are_one_line_errors(tmp_path, arguments):
    with pytest.raises(ValueError, match="flops_per|precision") as raised:
        pull_monitor(tmp_path, "flops-bad", **arguments)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("how, precision", [("fp32", "fp32"), ("autocast bf16", "bf16"),
                                            ("GradScaler", "fp16"), ("bf16 parameters", "bf16"),
                                            ("not watched", "unknown")])
def test_the_precision_is_read_from_the_model_never_assumed(tmp_path, how, precision):
    """Without precision=: autocast's dtype at the first forward, an enabled GradScaler (fp16), the
    parameters' dtype, else "unknown" (no MFU); the live series and the record's start line agree."""
    with pull_monitor(tmp_path, "precision", flops_per_token=1e9) as monitor:
        if how == "bf16 parameters":
            torch.set_default_dtype(torch.bfloat16)
        try:
            train(monitor, steps=3, watch=how != "not watched",
                  autocast=torch.bfloat16 if how == "autocast bf16" else None,
                  scaler=torch.amp.GradScaler("cpu") if how == "GradScaler" else None)
        finally:
            torch.set_default_dtype(torch.float32)
        assert wait_pulled(monitor, FLOPS, lambda v: v == 3 * 32 * 1e9, precision=precision) == 3 * 32 * 1e9
    _, events = record_lines(tmp_path / "record.jsonl")
    assert events[0]["event"] == "start" and events[0]["precision"] == precision
