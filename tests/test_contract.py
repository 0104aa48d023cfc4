"""The hook's metric contract: the live hook and `dualtrack replay` export the same series for the
same steps, and the `dualtrack` command never loads torch."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from dualtrack.records import Reader
from dualtrack.replay import write_openmetrics
from stack import processes
from stack.processes import REPO
from tests.hook_support import pull_monitor, pulled, run_id, wait_pulled
from tests.test_hook_watch import Fp16Run
from trainer_hook import TrainingMonitor

#: Live series a record cannot hold, so replay cannot rebuild them: the GPUs and the process
#: (training_gpu_info, training_process_info), the monitor's own faults (dropped values, push and
#: record failures) and the Pushgateway's push_time_seconds / push_failure_time_seconds.
NOT_REPLAYED = {"training_gpu_info", "training_process_info", "training_dropped_values_total",
                "training_push_failures_total", "training_record_failures_total", "push_time_seconds",
                "training_last_push_timestamp_seconds",
                "push_failure_time_seconds"}
#: Series that hold a window maximum (live: over the push's window; replay: one per step).
MAXIMA = {"training_loss_max", "training_grad_norm_max"}
_SAMPLE = re.compile(r'^(\w+)\{(.*)\} (\S+) (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def feed(monitor: TrainingMonitor, watch_scaler: bool) -> None:
    """A mixed sequence: a real fp16 loop whose GradScaler skips overflow steps (counted as skipped
    when the scaler is watched, as non-finite norms otherwise), keys logged by their W&B names,
    numpy batch ids, a grad-norm spike followed at once by an infinite one, NaN/Inf losses in two
    streaks."""
    run = Fp16Run()
    monitor.watch(run.model, run.optimizer, scaler=run.scaler if watch_scaler else None)
    step = 0

    def log(values: dict, **extra) -> None:
        nonlocal step
        monitor.log(values, step=step, samples=64, tokens=64 * 32, batch_id=np.int64(1000 + step),
                    data_wait=0.001 * (step % 3), **extra)
        step += 1

    for n in range(24):
        loss, norm = run.step(loss_factor=float("nan") if n in (14, 15) else 1.0)
        log({"train/loss": loss, "grad_norm": norm, "val/acc": 0.5 + n / 100, "epoch": n // 10})
    log({"loss": 2.0, "grad_norm": 9.9e5})   # the spike ...
    log({"loss": math.inf, "grad_norm": math.inf})   # ... then Inf, in the same push
    log({"loss": math.nan, "grad_norm": 3.0})
    log({"loss": 1.5, "grad_norm": 2.0, "lr": 1e-3})


def live_series(text: str, run: str) -> Series:
    """Every sample the Pushgateway holds for `run`, labels without job/instance/run/rank."""
    series: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("run") == run:
                series[key(sample.name, sample.labels)] = sample.value
    return series


def replayed_series(text: str) -> tuple[Series, Series]:
    """(the last sample of each replayed series, the largest of each window-maximum series and the
    *_max_step at that sample)."""
    last: Series = {}
    largest: Series = {}
    raised: set = set()  # maxima whose *_max_step sample (the next line of the step) is the one to keep
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match[1], dict(_LABEL.findall(match[2])), float(match[3])
        assert labels.pop("replayed") == "true"
        series = key(name, labels)
        last[series] = value
        if name in MAXIMA and (series not in largest or value > largest[series]):
            largest[series] = value
            raised.add(key(name + "_step", labels))
        elif series in raised:
            largest[series] = value
            raised.discard(series)
    return last, largest


def key(name: str, labels: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    kept = {k: v for k, v in labels.items() if k not in ("job", "instance", "run", "rank")}
    if "le" in kept:
        kept["le"] = repr(float(kept["le"]))
    return name, tuple(sorted(kept.items()))


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-5)


@pytest.mark.parametrize("watch_scaler", [True, False], ids=["scaler-watched", "scaler-not-watched"])
def test_the_live_hook_and_replay_export_the_same_series_for_the_same_steps(tmp_path, start_service,
                                                                             watch_scaler: bool) -> None:
    pushgateway = start_service(processes.pushgateway(tmp_path))
    run = run_id("contract")
    record = tmp_path / "record.jsonl"
    # One window: every step lands in the final push, whose maxima then cover the whole run.
    with TrainingMonitor(job="contract", run=run, pushgateway=pushgateway.url, push_interval=3600,
                         delete_after=None, record_path=record, config={"lr": 0.01, "model": "mlp"}) as monitor:
        feed(monitor, watch_scaler)
    live = live_series(requests.get(pushgateway.url + "/metrics", timeout=5).text, run)

    class Capture:
        text = ""

        def write(self, text: str, samples: int) -> None:
            self.text += text

    capture = Capture()
    write_openmetrics(Reader([record]), capture)
    last, largest = replayed_series(capture.text)

    assert {name for name, _ in live} - NOT_REPLAYED == {name for name, _ in last}
    differ = {}
    for series, value in live.items():
        if series[0] in NOT_REPLAYED:
            continue
        replayed = largest[series] if series[0] in MAXIMA or series[0][:-5] in MAXIMA else last[series]
        if not same(value, replayed):
            differ[series] = (value, replayed)
    assert differ == {}, "live vs replayed"
    # The sequence did what it says (so the comparison above covers it).
    steps = [json.loads(line) for line in record.read_text().splitlines()[1:-1]]
    skipped = sum(line.get("skipped") == "overflow" for line in steps)
    assert live[key("training_skipped_steps_total", {"reason": "overflow"})] == skipped
    assert live[key("training_grad_norm_max", {})] == 9.9e5
    assert live[key("training_first_nonfinite_step", {})] == 25
    assert live[key("training_first_nonfinite_batch_id", {})] == 1025
    params = sum(p.numel() for p in Fp16Run().model.parameters())  # watch()'s estimate: 6 x params x tokens
    assert live[key("training_model_flops_total", {"precision": "bf16"})] == 6 * params * 64 * 32 * len(steps)
    if watch_scaler:
        assert 3 <= skipped < 20
        assert live[key("training_nonfinite_values_total", {"key": "grad_norm"})] == 1
    else:
        assert skipped == 0 and live[key("training_nonfinite_values_total", {"key": "grad_norm"})] > 1


def test_a_spike_followed_by_inf_in_one_push_keeps_the_spike_and_its_step(tmp_path) -> None:
    """The largest finite value is the window maximum; the Inf right after it is counted apart."""
    # Whatever the push boundaries, max_hold (30 s) merges these steps' windows into one maximum.
    with pull_monitor(tmp_path, "spike") as monitor:
        for step in range(2790, 2797):
            monitor.log({"grad_norm": torch.tensor(1.0 + step % 3), "loss": 0.5}, step=step)
        monitor.log({"grad_norm": torch.tensor(9.9e5), "loss": 0.7}, step=2797)
        monitor.log({"grad_norm": torch.tensor(math.inf), "loss": math.inf}, step=2798, batch_id=11)
        monitor.log({"grad_norm": torch.tensor(math.nan), "loss": math.nan}, step=2799)
        wait_pulled(monitor, "training_steps_total", lambda v: v == 10)
        assert pulled(monitor, "training_grad_norm_max") == 9.9e5
        assert pulled(monitor, "training_grad_norm_max_step") == 2797
        assert pulled(monitor, "training_loss_max") == 0.7
        assert pulled(monitor, "training_loss_max_step") == 2797
        assert pulled(monitor, "training_grad_norm") != pulled(monitor, "training_grad_norm")  # NaN, last
        assert pulled(monitor, "training_nonfinite_values_total", key="grad_norm") == 2
        assert pulled(monitor, "training_first_nonfinite_step") == 2798
        assert pulled(monitor, "training_first_nonfinite_batch_id") == 11


#: Runs `dualtrack ARGS...` in this process and prints whether torch got imported (even on exit 2).
_PROBE = ("import sys\nfrom dualtrack.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
          "except SystemExit as exc:\n    code = exc.code\nprint('TORCH', 'torch' in sys.modules, code)\n")


@pytest.mark.parametrize("command", ["--help", "report", "janitor", "replay"])
def test_dualtrack_commands_never_import_torch(tmp_path: Path, command: str) -> None:
    record = tmp_path / "r.jsonl"
    record.write_text("\n".join(json.dumps(line) for line in [
        {"event": "start", "format": 2, "time": 1000.0, "job": "j", "run": "r", "rank": 0, "instance": "n"},
        {"time": 1000.5, "step": 0, "values": {"loss": 1.0, "grad_norm": "inf"}, "nonfinite": ["grad_norm"]},
        {"time": 1001.0, "step": 1, "values": {"loss": 0.5, "grad_norm": 2.0}},
        {"event": "end", "time": 1002.0, "state": "finished", "steps": 2}]) + "\n")
    argv = {"--help": ["--help"],
            "report": ["report", str(record), "--out", str(tmp_path / "r.html")],
            "janitor": ["janitor", "--once", f"--pushgateway=http://127.0.0.1:{processes.free_port()}",
                        "--timeout=1s"],
            "replay": ["replay", str(record), "--out", str(tmp_path / "blocks")]}[command]
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    torch_loaded, code = done.stdout.split("TORCH ")[-1].split()
    assert code == {"janitor": "1"}.get(command, "0"), done.stderr
    assert torch_loaded == "False", f"dualtrack {command} imported torch"
