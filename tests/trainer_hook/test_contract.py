"""The hook's metric contract: the live hook and `dualtrack replay` export the same series for the
same steps, and the `dualtrack` command never loads torch."""
from __future__ import annotations

import ast
import dataclasses
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

from dualtrack.openmetrics import sample_head
from stack import processes
from tests.support.hook import Fp16Run, pull_monitor, pulled, run_id, wait_pulled
from tests.support.paths import REPO
from tests.support.records import replayed_text
from trainer_hook import TrainingMonitor, remote_write
from trainer_hook.contract import (
    KNOWN_KEYS,
    PREFIX,
    RESERVED,
    SERIES,
    SERIES_BY_NAME,
    Dropped,
    ProcessIdentity,
    Series,
    Snapshot,
    label_value,
    metric_suffix,
)
from trainer_hook.families import families
from trainer_hook.text import one_line

#: Declared series a record does not hold, so replay cannot rebuild them, and why.
NOT_IN_A_RECORD = {
    "gpu_info": "the record does not say which GPUs the rank trained on",
    "process_info": "the record does not hold the host name (pid_namespace and pid alone join nothing)",
    "last_push_timestamp_seconds": "the record does not say when the hook pushed",
    "dropped_values": "the monitor's own faults are not record lines",
    "push_failures": "the monitor's own faults are not record lines",
    "record_failures": "the monitor's own faults are not record lines",
    "cuda_alloc_retries": "a step line's cuda field holds allocated and reserved bytes only",
    "cuda_ooms": "a step line's cuda field holds allocated and reserved bytes only",
    "replica_compared_steps": "the comparison with the peers' norms happens live, the record holds this rank's",
    "replica_divergent_steps": "the comparison with the peers' norms happens live, the record holds this rank's",
    **dict.fromkeys(("collective_wait_seconds", "compute_seconds", "collectives", "collective_sequence"),
                    "the collectives' timing is the hook's, not a step line's"),
    **dict.fromkeys(("rank_phase", "rank_frame_info"), "what the training thread does now is not a step line"),
}
#: Live samples replay does not write: those of NOT_IN_A_RECORD, and the Pushgateway's
#: push_time_seconds / push_failure_time_seconds.
NOT_REPLAYED = {PREFIX + name for series in SERIES if series.name in NOT_IN_A_RECORD
                for name in series.sample_names()} | {"push_time_seconds", "push_failure_time_seconds"}
#: Series that hold a window maximum (live: over the push's window; replay: one per step).
MAXIMA = {"training_loss_max", "training_grad_norm_max", "training_learning_rate_max"}
_SAMPLE = re.compile(r'^(\w+)\{(.*)\} (\S+) (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


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


def live_series(text: str, run: str) -> Samples:
    """Every sample the Pushgateway holds for `run`, labels without job/instance/run/rank."""
    series: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("run") == run:
                series[key(sample.name, sample.labels)] = sample.value
    return series


def replayed_series(text: str) -> tuple[Samples, Samples]:
    """(the last sample of each replayed series, the largest of each window-maximum series and the
    *_max_step at that sample)."""
    last: Samples = {}
    largest: Samples = {}
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

    last, largest = replayed_series(replayed_text(record))

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
    # the precision watch() read: fp16 autocast at the first forward (and the GradScaler when watched)
    assert live[key("training_model_flops_total", {"precision": "fp16"})] == 6 * params * 64 * 32 * len(steps)
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


def test_a_learning_rate_jump_that_a_rollback_undid_within_a_push_still_shows(tmp_path) -> None:
    """The demo's explosion: the learning rate jumps x1e4 for one step, the run rolls back to its checkpoint
    (and its learning rate) at once; the gauge shows the last value, the window maximum the jump."""
    with pull_monitor(tmp_path, "lr") as monitor:
        for step in range(10):
            monitor.log({"learning_rate": 300.0 if step == 6 else 0.03, "loss": 0.5}, step=step)
        wait_pulled(monitor, "training_steps_total", lambda v: v == 10)
        assert pulled(monitor, "training_learning_rate") == 0.03
        assert pulled(monitor, "training_learning_rate_max") == 300.0
        assert pulled(monitor, "training_learning_rate_max_step") == 6


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


# ---------------------------------------------------------------------- one declaration per series
def _full_snapshot() -> Snapshot:
    """A snapshot in which every declared series has a sample: a failed run with GPUs, CUDA, tokens,
    model FLOPs, window maxima, skipped steps, dropped values, a config and timed collectives."""
    return Snapshot(gauges={"loss": 1.0, "custom": math.nan},
                    maxima={"loss": 3.0, "grad_norm": 5.0, "learning_rate": 0.1},
                    max_steps={"loss": 1, "grad_norm": 2, "learning_rate": 3}, value_sums={"loss": 3.0},
                    value_counts={"loss": 2},
                    nonfinite_values={"custom": 1}, step=5, tokens_total=7.0, model_flops_total=4.2e15,
                    precision="fp8", state="failed",
                    failure_reason="OutOfMemoryError", run_labels={"lr": "0.1"}, gpus=(("0", "GPU-1"),),
                    cuda={"allocated": 1.0, "reserved": 2.0, "retries": 3, "ooms": 4},
                    process=ProcessIdentity(1, 2, 3, "host", "4026531836", "123456", "launch-1"),
                    dropped={"invalid_key": 2}, skipped_steps_total=3, paused_seconds={"checkpoint": 2.5},
                    pause=("checkpoint", 100.0), replica=(4, 1), collective_wait=1.5, compute=2.5,
                    collectives_total=6, collective_sequence=7, phase="loader", frame="batches (train.py:12)")


def _declared(sample: str) -> Series:
    """The declared series a sample name (without PREFIX) belongs to."""
    found = [series for series in SERIES if sample in series.sample_names()[1:] or sample == series.name]
    assert len(found) == 1, f"training_{sample} is not declared in trainer_hook.contract.SERIES"
    return found[0]


def test_every_name_a_series_takes_is_reserved_run_failure_info_included() -> None:
    """A logged key named like a series the hook computes (any of its samples) is dropped as
    reserved_name: a logged `run_failure_info` would collide with a failed run's own."""
    for series in SERIES:
        for name in series.sample_names():
            assert name in RESERVED
            assert metric_suffix(name) == "reserved_name" and isinstance(metric_suffix(name), Dropped), name
    assert RESERVED == {name for series in SERIES for name in series.sample_names()}
    assert metric_suffix("train/run_failure_info") == "reserved_name"


def test_a_logged_run_failure_info_does_not_collide_with_the_failed_runs_own(tmp_path) -> None:
    """The logged key is dropped (reason reserved_name), so training_run_failure_info stays the
    failed run's own family (a gauge of the same name beside it is a push the Pushgateway refuses)."""
    with pull_monitor(tmp_path, "collide") as monitor:
        monitor.log({"run_failure_info": 5.0, "loss": 1.0}, step=0)
        wait_pulled(monitor, "training_dropped_values_total", lambda v: v == 1, reason="reserved_name")
        assert pulled(monitor, "training_run_failure_info") is None


def test_the_live_exposition_is_the_declaration() -> None:
    """Every declared series is exported with its declared type, HELP and labels, and nothing else
    is (besides the logged keys' gauges)."""
    exported = {family.name: family for family in families(_full_snapshot(), {"run": "r", "rank": "0"})}
    for series in SERIES:
        family = exported.pop(PREFIX + series.name)
        assert (family.type, family.documentation) == (series.type, series.help), series.name
        labels = {name for sample in family.samples for name in sample.labels} - {"run", "rank", "le"}
        if series.name == "run_info":
            assert labels == {"lr"}
        else:
            assert labels == set(series.labels), series.name
    assert set(exported) == {"training_loss", "training_custom"}
    assert exported["training_loss"].documentation == KNOWN_KEYS["loss"]


def test_remote_write_sends_the_declared_series() -> None:
    samples = remote_write.batch(_full_snapshot(), {"job": "j", "run": "r"}, 1000.0).samples
    names = {dict(labels)["__name__"][len(PREFIX):] for labels, _ in samples}
    assert {_declared(name).name for name in names - {"loss", "custom"}} == {series.name for series in SERIES}


#: A record in which every series replay rebuilds has a sample: logged keys (one only ever non-finite),
#: tokens, model FLOPs, step durations, data wait, skipped steps, the loss scale, CUDA memory, a failed
#: end with its reason, a config.
_EVERY_SERIES = [
    {"event": "start", "format": 2, "time": 1000.0, "job": "j", "run": "r", "rank": 0, "instance": "n",
     "local_rank": 0, "world_size": 2, "precision": "fp16", "config": {"lr": 0.1}},
    {"time": 1000.5, "step": 0, "values": {"loss": 1.0, "grad_norm": "inf", "custom": "nan", "learning_rate": 0.1},
     "nonfinite": ["grad_norm", "custom"], "samples": 8, "tokens": 64, "flops": 3.8e12, "duration_seconds": 0.2,
     "data_wait_seconds": 0.01, "loss_scale": 1024.0, "skipped": "overflow", "cuda": {"allocated": 10, "reserved": 20}},
    {"time": 1001.0, "step": 1, "values": {"loss": "nan", "grad_norm": 2.0}, "nonfinite": ["loss"]},
    {"event": "pause", "reason": "checkpoint", "time": 1001.2, "seconds": 0.5},
    {"event": "end", "time": 1002.0, "state": "failed", "reason": "OutOfMemoryError", "steps": 2}]
_RUN_LABELS = ("job", "run", "rank", "instance", "replayed")


def test_replay_writes_the_samples_the_live_exposition_declares(tmp_path) -> None:
    """Replay writes exactly the samples (names, and label names in their order) that the live exposition
    makes of the same state, but for the series a record does not hold (NOT_IN_A_RECORD)."""
    record = tmp_path / "r.jsonl"
    record.write_text("\n".join(json.dumps(line) for line in _EVERY_SERIES) + "\n")
    replayed = set()
    for line in replayed_text(record).splitlines():
        match = _SAMPLE.match(line)
        assert match, line
        names = tuple(name for name, _ in _LABEL.findall(match[2]))
        assert names[:len(_RUN_LABELS)] == _RUN_LABELS, line
        replayed.add((match[1], names[len(_RUN_LABELS):]))
    # The state the hook would publish for those steps: the same keys, a failed run, CUDA memory, ...
    snapshot = dataclasses.replace(_full_snapshot(), gauges={"loss": 1.0, "grad_norm": 2.0, "custom": math.nan,
                                                             "loss_scale": 1024.0, "learning_rate": 0.1})
    live = {(sample.name, tuple(sample.labels)) for family in families(snapshot, {}) for sample in family.samples
            if family.name[len(PREFIX):] not in NOT_IN_A_RECORD}
    assert replayed == live
    assert {name[len(PREFIX):] for name, _ in live} >= {name for series in SERIES if series.name not in NOT_IN_A_RECORD
                                                        for name in series.sample_names()[1:] or [series.name]}


def test_a_sample_head_is_the_declared_name_and_labels() -> None:
    """Replay's one sample writer takes the names from the declaration and refuses what it does not declare."""
    labels = 'job="j"'
    assert sample_head(SERIES_BY_NAME["skipped_steps"], labels, "overflow") \
        == 'training_skipped_steps_total{job="j",reason="overflow"} '
    assert sample_head(SERIES_BY_NAME["step_duration_seconds"], labels, "+Inf", sample="_bucket") \
        == 'training_step_duration_seconds_bucket{job="j",le="+Inf"} '
    assert sample_head(SERIES_BY_NAME["run_failure_info"], labels, 'a"b') \
        == 'training_run_failure_info{job="j",reason="a\\"b"} '
    with pytest.raises(ValueError, match="labels"):
        sample_head(SERIES_BY_NAME["skipped_steps"], labels)  # a declared label without its value
    with pytest.raises(ValueError, match="labels"):
        sample_head(SERIES_BY_NAME["steps"], labels, "overflow")  # a value for an undeclared label
    with pytest.raises(ValueError, match="no sample"):
        sample_head(SERIES_BY_NAME["steps"], labels, sample="_bucket")
    with pytest.raises(ValueError, match="no sample"):
        sample_head(SERIES_BY_NAME["logged_value"], labels, "loss")  # _sum or _count?


def test_replay_spells_no_series_or_label_name() -> None:
    """dualtrack/openmetrics.py names samples and labels only through the declaration (sample_head):
    none of its strings but docstrings holds PREFIX, a `_total`, a `name{` or a `name="`."""
    tree = ast.parse((REPO / "dualtrack/openmetrics.py").read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            assert PREFIX not in node.value and "_total" not in node.value, node.value
            assert not re.search(r"\w(\{|=)", node.value), f"line {node.lineno}: {node.value!r} spells a sample"


def test_the_docs_name_the_series_replay_does_not_write() -> None:
    text = " ".join((REPO / "docs/postmortem.md").read_text().split())
    listed = text.split("Not in a record, so not replayed: ")[1].split(".")[0]
    assert set(re.findall(r"`training_(\w+)`", listed)) == {
        series.sample_names()[-1] for series in SERIES if series.name in NOT_IN_A_RECORD}


_DOC_ROW = re.compile(r"^\| ((?:`training_\w+`(?:, )?)+) \| ([^|]+) \|(.*)\|$")


def _documented(path: Path, labels_column: int) -> dict[str, tuple[str, set[str]]]:
    """metric suffix -> (type, label names) of each `training_*` row of the table in `path`."""
    rows = {}
    for line in path.read_text().splitlines():
        match = _DOC_ROW.match(line)
        if match:
            kind = match[2].split()[0]
            labels = set(re.findall(r"`(\w+)", match[3].split("|")[labels_column]))
            for name in re.findall(r"`training_(\w+)`", match[1]):
                rows[name] = (kind, labels)
    return rows


@pytest.mark.parametrize("doc, labels_column", [("docs/hook.md", 1), ("docs/metrics.md", 0)])
def test_the_docs_tables_agree_with_the_declaration(doc: str, labels_column: int) -> None:
    """Each documented training_* series is declared, with the declared type and labels; the hook's
    full table (docs/hook.md) names every declared series and documented key."""
    documented = _documented(REPO / doc, labels_column)
    assert documented
    for name, (kind, labels) in documented.items():
        if name in KNOWN_KEYS or name == "key":
            assert (kind, labels) == ("gauge", set()), name
            continue
        series = _declared(name)
        assert kind == series.type, f"{doc}: training_{name} is a {series.type}"
        expected = set(series.labels) | ({"le"} if series.type == "histogram" else set())
        assert labels == expected, f"{doc}: training_{name} has the labels {sorted(expected)}"
    if doc == "docs/hook.md":
        named = {_declared(name).name for name in documented if name not in KNOWN_KEYS and name != "key"}
        assert named == {series.name for series in SERIES}
        assert set(KNOWN_KEYS) <= set(documented)


def test_label_values_and_the_commands_messages_share_one_control_character_rule() -> None:
    """Every character the `dualtrack` command escapes in a message (C0, DEL, C1: a terminal's CSI
    \\x9b as well as ESC) is blanked in a label value, and no other."""
    for code in range(0x3000):
        char = chr(code)
        escaped = one_line(f"a{char}b") != f"a{char}b"
        blanked = label_value(f"a{char}b") != f"a{char}b"
        assert blanked == escaped and (not blanked or label_value(f"a{char}b") == "a b"), hex(code)
    assert label_value("run\x1b]0;x\x07\x9b31m\nname") == "run ]0;x 31m name"
