"""trainer_hook API without daemons: arguments, keys, values, record, watch, loader, grad_norm, pull mode."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import requests
import torch

from stack.processes import free_port, wait_until
from tests.support.hook import Trainer, record_lines
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor, grad_norm


def monitor(tmp_path, **kwargs) -> TrainingMonitor:
    kwargs.setdefault("job", "unit")
    kwargs.setdefault("run", "r1")
    kwargs.setdefault("pushgateway", False)
    kwargs.setdefault("record_path", tmp_path / "record.jsonl")
    kwargs.setdefault("push_interval", 0.2)
    return TrainingMonitor(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"job": ""}, "job must be a non-empty string"),
    ({"job": "   "}, "job must be a non-empty string"),
    ({"pushgateway": "ftp://host:9091"}, "http(s) URL"),
    ({"pushgateway": "http://"}, "http(s) URL"),
    ({"pushgateway": "http://host:port"}, "invalid port"),
    ({"pushgateway": 9091}, "must be a URL"),
    ({"push_interval": 0}, "push_interval must be a positive"),
    ({"push_interval": "often"}, "push_interval must be a number"),
    ({"listen_port": 70000}, "listen_port"),
    ({"basic_auth": ("user",)}, "basic_auth"),
    ({"basic_auth": ("u", "p"), "bearer_token": "t"}, "either basic_auth or bearer_token"),
    ({"ca_file": "/nonexistent/ca.pem"}, "ca_file"),
    ({"ca_file": "NOT_PEM", "pushgateway": "https://127.0.0.1:9091"}, "cannot use the TLS files"),
    ({"config": 42}, "config must be a mapping"),
    ({"max_hold": -1}, "max_hold must be a positive"),
])
def test_invalid_arguments_raise_value_error_at_construction(tmp_path, kwargs, message):
    if kwargs.get("ca_file") == "NOT_PEM":
        (tmp_path / "ca.pem").write_text("not a certificate")
        kwargs = {**kwargs, "ca_file": str(tmp_path / "ca.pem")}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        monitor(tmp_path, **kwargs)


def test_the_constructor_takes_each_setting_once_and_names_an_unknown_keyword(tmp_path):
    """Every constructor argument but `config` is a Settings field (or resolves into one, as listed in
    settings.RESOLVED_INTO), and every field has an argument: the two cannot drift apart."""
    import inspect

    from trainer_hook.settings import check_arguments
    arguments = set(inspect.signature(TrainingMonitor).parameters) - {"config"}
    check_arguments(arguments)
    with pytest.raises(TypeError, match="no argument for .'max_hold'"):
        check_arguments(arguments - {"max_hold"})
    with pytest.raises(TypeError, match="no field for .'max_hold_seconds'"):
        check_arguments(arguments | {"max_hold_seconds"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'pushgatway'") as raised:
        monitor(tmp_path, pushgatway="http://127.0.0.1:9091")
    assert "\n" not in str(raised.value)
    table = REPO.joinpath("docs", "hook.md").read_text().split("### `TrainingMonitor(...)`")[1].split("\n\n")[1]
    assert sorted(re.findall(r"^\| `(\w+)` \|", table, re.M)) == sorted(inspect.signature(TrainingMonitor).parameters)


def test_pull_mode_port_in_use_raises_value_error(tmp_path):
    with monitor(tmp_path, listen_port=0) as first:
        with pytest.raises(ValueError, match="cannot serve /metrics"):
            monitor(tmp_path, run="r2", listen_port=first.listen_port)


def test_settings_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DUALTRACK_JOB", "envjob")
    monkeypatch.setenv("DUALTRACK_RUN", "envrun")
    monkeypatch.setenv("DUALTRACK_PUSHGATEWAY", "127.0.0.1:1")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with TrainingMonitor(record_path=False, push_timeout=0.2) as m:
        s = m.settings
        assert (s.job, s.run, s.rank, s.local_rank) == ("envjob", "envrun", 3, 1)
        assert s.pushgateway == "http://127.0.0.1:1"
        assert s.grouping_key["instance"]  # the host name


def test_default_record_path_names_job_run_and_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with TrainingMonitor(job="pre train", run="lr/3e-4", pushgateway=False, rank=2) as m:
        m.log({"loss": 1.0})
    steps, _ = record_lines(tmp_path / "dualtrack-records" / "pre_train-lr_3e-4-rank2.jsonl")
    assert steps[0]["values"] == {"loss": 1.0}


def test_record_holds_every_step_with_values_batch_and_events(tmp_path):
    with monitor(tmp_path, config={"lr": 0.1}) as m:
        for step in range(500):
            m.log({"loss": torch.tensor(step / 10), "train/acc": 0.5}, step=step, samples=4,
                  batch_id=f"shard0:{step}", tokens=torch.tensor(100))
    steps, events = record_lines(tmp_path / "record.jsonl")
    assert [x["step"] for x in steps] == list(range(500))
    assert steps[123]["values"] == {"loss": pytest.approx(12.3), "train/acc": 0.5}
    assert (steps[123]["batch_id"], steps[123]["samples"], steps[123]["tokens"]) == ("shard0:123", 4, 100)
    assert [e["event"] for e in events] == ["start", "end"]
    assert events[0]["config"] == {"lr": "0.1"} and events[1]["state"] == "finished"


def test_step_defaults_to_the_previous_plus_one_or_a_step_key(tmp_path):
    with monitor(tmp_path) as m:
        m.log({"loss": 1.0})
        m.log({"loss": 1.0})
        m.log({"loss": 1.0, "step": 10})
        m.log({"loss": 1.0})
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [x["step"] for x in steps] == [0, 1, 10, 11]


def test_wandb_style_keys_and_aliases_map_to_the_contract_names(tmp_path):
    with monitor(tmp_path, listen_port=0) as m:
        m.log({"train/loss": 0.5, "lr": 1e-3, "val/acc": 0.9, "gradnorm": 2.0}, step=1)
        text = wait_until(lambda: (t := requests.get(f"http://127.0.0.1:{m.listen_port}/metrics").text)
                          and "training_val_acc" in t and t, timeout=10)
    for line in ('training_loss{rank="0",run="r1"} 0.5', 'training_learning_rate{rank="0",run="r1"} 0.001',
                 'training_val_acc{rank="0",run="r1"} 0.9', 'training_grad_norm{rank="0",run="r1"} 2.0'):
        assert line in text


def test_pull_mode_serves_the_state_with_run_and_rank_labels(tmp_path):
    with monitor(tmp_path, listen_port=0, config={"batch_size": 8}) as m:
        for step in range(5):
            m.log({"loss": float(step)}, step=step, samples=8)
        url = f"http://127.0.0.1:{m.listen_port}/metrics"
        text = wait_until(lambda: (t := requests.get(url).text) and "training_steps_total" in t
                          and 'training_steps_total{rank="0",run="r1"} 5.0' in t and t, timeout=10)
    assert 'training_samples_total{rank="0",run="r1"} 40.0' in text
    assert 'training_run_info{batch_size="8",rank="0",run="r1"} 1.0' in text
    assert 'training_run_state{rank="0",run="r1",state="running"} 1.0' in text
    with pytest.raises(requests.ConnectionError):  # closed: the port is released
        requests.get(url, timeout=2)


def test_watch_captures_grad_norm_before_the_step_and_the_learning_rate(tmp_path):
    trainer = Trainer()
    expected = []
    with monitor(tmp_path) as m:
        m.watch(trainer.model, trainer.optimizer)
        for step in range(5):
            x, y = trainer.batches[step]
            loss = torch.nn.functional.mse_loss(trainer.model(x), y)
            trainer.optimizer.zero_grad()
            loss.backward()
            expected.append(torch.nn.utils.get_total_norm(
                [p.grad for p in trainer.model.parameters()]).item())
            trainer.optimizer.step()
            m.log({"loss": loss}, step=step)
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [x["values"]["grad_norm"] for x in steps] == pytest.approx(expected, rel=1e-5)
    assert all(x["values"]["learning_rate"] == pytest.approx(0.01) for x in steps)
    trainer.optimizer.step()  # hooks are removed on close: no error, nothing recorded
    assert len(record_lines(tmp_path / "record.jsonl")[0]) == 5


def test_loader_counts_the_time_waiting_for_batches(tmp_path):
    def slow_batches():
        for i in range(5):
            time.sleep(0.03)  # a slow input pipeline
            yield i

    with monitor(tmp_path, listen_port=0) as m:
        assert list(m.loader(slow_batches())) == [0, 1, 2, 3, 4]
        m.log({"loss": 1.0})
        url = f"http://127.0.0.1:{m.listen_port}/metrics"
        text = wait_until(lambda: (t := requests.get(url).text) and "steps_total{rank=\"0\",run=\"r1\"} 1.0" in t
                          and t, timeout=10)
    wait = float(text.split('training_data_wait_seconds_total{rank="0",run="r1"} ')[1].split()[0])
    assert 0.14 <= wait < 1.0


def test_grad_norm_matches_torch_and_is_a_0d_tensor():
    trainer = Trainer()
    x, y = trainer.batches[0]
    torch.nn.functional.mse_loss(trainer.model(x), y).backward()
    params = list(trainer.model.parameters())
    ours = grad_norm(params)
    assert ours.dim() == 0
    reference = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    assert grad_norm(params, norm_type=float("inf")).item() == pytest.approx(
        max(p.grad.abs().max().item() for p in params))
    assert grad_norm([torch.nn.Parameter(torch.ones(3))]).item() == 0.0  # no gradients yet


def test_grad_norm_handles_mixed_dtypes():
    a = torch.nn.Parameter(torch.ones(4))
    b = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    a.grad, b.grad = torch.full((4,), 3.0), torch.full((4,), 4.0, dtype=torch.float64)
    assert grad_norm([a, b]).item() == pytest.approx((9 * 4 + 16 * 4) ** 0.5)


def test_log_after_close_is_counted_not_raised(tmp_path, caplog):
    m = monitor(tmp_path)
    m.log({"loss": 1.0})
    m.close()
    m.close()  # idempotent
    with caplog.at_level(logging.WARNING, logger="trainer_hook"):
        m.log({"loss": 2.0})
    assert "log() after close() is ignored" in caplog.text
    steps, events = record_lines(tmp_path / "record.jsonl")
    assert len(steps) == 1 and [e["event"] for e in events] == ["start", "end"]


def test_works_with_python_numbers_when_torch_is_not_installed(tmp_path):
    script = f"""
import sys
sys.modules["torch"] = None  # import torch -> ImportError
from trainer_hook import TrainingMonitor
with TrainingMonitor(job="j", run="r", pushgateway=False, record_path={str(tmp_path / 'r.jsonl')!r}) as m:
    m.log({{"loss": 0.25, "epoch": 1}}, step=7, samples=3)
"""
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=60)
    steps, _ = record_lines(tmp_path / "r.jsonl")
    assert steps[0]["values"] == {"loss": 0.25, "epoch": 1.0} and steps[0]["step"] == 7


def test_record_is_written_while_training_runs(tmp_path):
    with monitor(tmp_path) as m:
        for step in range(10):
            m.log({"loss": 1.0}, step=step)
        wait_until(lambda: len(record_lines(tmp_path / "record.jsonl")[0]) == 10, timeout=10)
    json.loads((tmp_path / "record.jsonl").read_text().splitlines()[0])


def _scrape_value(port: int, sample: str) -> float | None:
    for line in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None


@pytest.mark.parametrize("max_hold, kept", [(0.0, False), (30.0, True)])
def test_window_max_holds_a_spike_for_max_hold_seconds(tmp_path, max_hold, kept):
    labels = '{rank="0",run="r1"}'
    with monitor(tmp_path, listen_port=0, max_hold=max_hold) as m:
        m.log({"grad_norm": 1.0})
        m.log({"grad_norm": 1e6})  # a one-step spike
        m.log({"grad_norm": 2.0})
        wait_until(lambda: _scrape_value(m.listen_port, f"training_grad_norm_max{labels}") == 1e6, timeout=10)
        m.log({"grad_norm": 3.0}, step=10)
        wait_until(lambda: _scrape_value(m.listen_port, f"training_step{labels}") == 10, timeout=10)
        assert _scrape_value(m.listen_port, f"training_grad_norm_max{labels}") == (1e6 if kept else 3.0)
        assert _scrape_value(m.listen_port, f"training_grad_norm{labels}") == 3.0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_exposition_passes_promtool_check_metrics(tmp_path):
    with monitor(tmp_path, listen_port=0, gpu_uuid="GPU-8d3c2b1a-0000-1111-2222-333344445555",
                 config={"lr": 0.1, "name": 'a "b"\nc'}, flops_per_token=1e9) as m:
        m.log({"loss": 1.0, "grad_norm": 2.0, "learning_rate": 0.1, "epoch": 1, "val/acc": 0.5},
              samples=3, tokens=10)
        url = f"http://127.0.0.1:{m.listen_port}/metrics"
        text = wait_until(lambda: (t := requests.get(url).text) and "training_tokens_total" in t and t, timeout=10)
    assert 'training_model_flops_total{precision="unknown",rank="0",run="r1"} 1e+10' in text
    assert 'training_gpu_info{gpu="0",rank="0",run="r1",uuid="GPU-8d3c2b1a-0000-1111-2222-333344445555"} 1.0' in text
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


DISTRIBUTED_SCRIPT = """
import sys
import torch.distributed as dist
from trainer_hook import TrainingMonitor
rank, port, record_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
with TrainingMonitor(job="ddp", run="r", pushgateway=False, record_path=record_dir) as monitor:
    monitor.log({"loss": float(rank)}, step=0)
dist.destroy_process_group()
"""


def test_rank_comes_from_torch_distributed_without_torchrun_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", DISTRIBUTED_SCRIPT, str(rank), port, str(tmp_path)],
                              cwd=REPO, env=env) for rank in (0, 1)]
    assert [p.wait(120) for p in procs] == [0, 0]
    for rank in (0, 1):
        steps, events = record_lines(tmp_path / f"ddp-r-rank{rank}.jsonl")
        assert events[0]["rank"] == rank and steps[0]["values"] == {"loss": float(rank)}
