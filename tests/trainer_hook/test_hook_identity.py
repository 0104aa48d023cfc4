"""Run identity: one run id per launch, rank / local rank / world size from every launcher."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from exporter.collectors.processes import identify
from stack import processes
from stack.processes import wait_until
from tests.support.hook import pushed_value, record_lines, run_id
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor

LAUNCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "RANK", "LOCAL_RANK",
                    "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID",
                    "SLURM_LOCALID", "SLURM_NTASKS", "DUALTRACK_RUN", "TORCHELASTIC_RESTART_COUNT",
                    "SLURM_RESTART_COUNT", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher variables from the machine running the tests."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def settings(tmp_path, **kwargs):
    kwargs.setdefault("job", "identity")
    with TrainingMonitor(pushgateway=False, record_path=tmp_path / "r.jsonl", **kwargs) as m:
        return m.settings


@pytest.mark.parametrize("env, run", [
    ({"TORCHELASTIC_RUN_ID": "a1b2c3", "SLURM_JOB_ID": "77"}, "a1b2c3"),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2"}, "77.2"),
    ({"SLURM_JOB_ID": "77"}, "77"),
    ({"SLURM_JOB_ID": "77", "DUALTRACK_RUN": "sweep-4"}, "sweep-4"),
])
def test_default_run_id_is_the_launchs_id(tmp_path, bare_env, env, run):
    for name, value in env.items():
        bare_env.setenv(name, value)
    assert settings(tmp_path).run == run
    assert settings(tmp_path, run="explicit").run == "explicit"


@pytest.mark.parametrize("env, launch", [
    ({"TORCHELASTIC_RUN_ID": "a1b2c3", "TORCHELASTIC_RESTART_COUNT": "0"}, "a1b2c3"),
    ({"TORCHELASTIC_RUN_ID": "a1b2c3", "TORCHELASTIC_RESTART_COUNT": "2"}, "a1b2c3.restart2"),
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2", "SLURM_RESTART_COUNT": "1"}, "77.2.restart1"),
    ({"PMIX_NAMESPACE": "prterun-node-1234@1", "DUALTRACK_RUN": "sweep-4"}, "prterun-node-1234@1"),
])
def test_the_start_line_names_the_launch_shared_by_its_ranks(tmp_path, bare_env, env, launch):
    """Each launch of a run id has its own id, the same on every rank (the launcher's, with its restarts):
    the record's start line and training_launch_info carry it."""
    for name, value in env.items():
        bare_env.setenv(name, value)
    record = tmp_path / "launch.jsonl"
    with TrainingMonitor(job="identity", run="r", pushgateway=False, record_path=record, rank=1, world_size=2):
        pass
    assert json.loads(record.read_text().splitlines()[0])["launch"] == launch


def test_without_a_launcher_each_launch_has_its_own_id(tmp_path, bare_env):
    record = tmp_path / "launch.jsonl"
    for _ in range(2):
        with TrainingMonitor(job="identity", run="r", pushgateway=False, record_path=record):
            pass
    launches = [json.loads(line)["launch"] for line in record.read_text().splitlines() if '"start"' in line]
    assert len(set(launches)) == 2 and all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", x) for x in launches)


def test_without_a_launcher_two_runs_started_in_the_same_second_differ(tmp_path, bare_env):
    runs = {settings(tmp_path).run for _ in range(5)}
    assert len(runs) == 5
    assert all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", run) for run in runs)


def test_an_automatic_run_id_is_said_once_at_start_and_public_as_monitor_run(tmp_path):
    """The id the hook chose is the one `dualtrack report`/`explain` and the alerts need: rank 0 says it
    in one line on stderr (logging not configured, as in a plain script); an id the user chose is not
    repeated."""
    script = ("from trainer_hook import TrainingMonitor\n"
              f"with TrainingMonitor(job='ident', pushgateway=False, record_path={str(tmp_path)!r}) as m:\n"
              "    print(m.run)\n"
              "with TrainingMonitor(job='ident', run='chosen', pushgateway=False,\n"
              f"                     record_path={str(tmp_path)!r}) as m:\n"
              "    print(m.run)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES})
    assert result.returncode == 0, result.stderr
    automatic, chosen = result.stdout.split()
    assert chosen == "chosen" and re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", automatic)
    lines = [line for line in result.stderr.splitlines() if "run " in line]
    assert lines == [f"trainer_hook: job ident run {automatic} (rank 0 of 1); pass run= or set $DUALTRACK_RUN "
                     "to choose the id"], result.stderr


def test_with_logging_configured_the_run_id_goes_through_the_logger(tmp_path, bare_env, caplog):
    caplog.set_level(logging.INFO, logger="trainer_hook")
    with TrainingMonitor(job="ident", pushgateway=False, record_path=tmp_path) as monitor:
        assert [r.getMessage() for r in caplog.records if "run " in r.getMessage()] == [
            f"job ident run {monitor.run} (rank 0 of 1); pass run= or set $DUALTRACK_RUN to choose the id"]
    caplog.clear()
    bare_env.setenv("DUALTRACK_RUN", "from-env")
    with TrainingMonitor(job="ident", pushgateway=False, record_path=tmp_path) as monitor:
        assert monitor.run == "from-env" and not caplog.records


def test_run_id_is_sanitized_to_a_label_value(tmp_path, bare_env):
    bare_env.setenv("TORCHELASTIC_RUN_ID", "job\nwith\tcontrol" + "x" * 400)
    run = settings(tmp_path).run
    assert run.startswith("job with control") and len(run) == 256
    with pytest.raises(ValueError, match="run must be a non-empty string"):
        settings(tmp_path, run="\n\n")


@pytest.mark.parametrize("env, identity", [
    ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
      "SLURM_NTASKS": "2"}, (5, 1, 8)),  # torchrun started by srun: torchrun's variables
    ({"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "16"}, (6, 2, 16)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
      "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}, (3, 3, 4)),  # mpirun in sbatch
    ({"PMI_RANK": "9", "PMI_SIZE": "12", "MPI_LOCALRANKID": "1"}, (9, 1, 12)),
    ({}, (0, 0, 1)),
])
def test_rank_local_rank_and_world_size_from_each_launcher(tmp_path, bare_env, env, identity, caplog):
    for name, value in env.items():
        bare_env.setenv(name, value)
    s = settings(tmp_path)
    assert (s.rank, s.local_rank, s.world_size) == identity
    assert "contradictory" not in caplog.text


def test_contradictory_settings_warn_once_and_the_arguments_win(tmp_path, bare_env, caplog):
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}.items():
        bare_env.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="trainer_hook"):
        s = settings(tmp_path, rank=2, local_rank=0)
    assert (s.rank, s.local_rank, s.world_size) == (2, 0, 4)
    warnings = [r.getMessage() for r in caplog.records if "contradictory" in r.getMessage()]
    assert len(warnings) == 1 and "rank=1 from $RANK" in warnings[0] and "local_rank=1 from $LOCAL_RANK" in warnings[0]
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        settings(tmp_path, world_size=0)


def test_identity_is_exported_and_the_local_rank_names_the_gpu(tmp_path, bare_env):
    for name, value in {"SLURM_JOB_ID": "501", "SLURM_PROCID": "7", "SLURM_LOCALID": "3",
                        "SLURM_NTASKS": "8"}.items():
        bare_env.setenv(name, value)
    with TrainingMonitor(job="identity", pushgateway=False, record_path=tmp_path, listen_port=0,
                         gpu_uuid="GPU-11111111-2222-3333-4444-555555555555") as m:
        m.log({"loss": 1.0})
        url = f"http://127.0.0.1:{m.listen_port}/metrics"
        stepped = 'training_steps_total{rank="7",run="501"} 1.0'
        text = wait_until(lambda: (t := requests.get(url).text) and stepped in t and t, timeout=10)
    labels = 'rank="7",run="501"'
    assert f"training_world_size{{{labels}}} 8.0" in text
    assert f"training_local_rank{{{labels}}} 3.0" in text
    namespace = os.stat("/proc/self/ns/pid").st_ino  # what the exporter reads of this pid
    started = identify(os.getpid(), Path("/proc")).start_time  # and what any user reads of it
    assert started.isdigit()
    assert (f'training_process_info{{hostname="{os.uname().nodename}",pid="{os.getpid()}",'
            f'pid_namespace="{namespace}",{labels},start_time="{started}"}} 1.0') in text
    assert f'training_gpu_info{{gpu="3",{labels},uuid="GPU-11111111-2222-3333-4444-555555555555"}} 1.0' in text
    _, events = record_lines(tmp_path / "identity-501-rank7.jsonl")
    start = events[0]
    assert (start["format"], start["run"], start["rank"], start["local_rank"], start["world_size"],
            start["pid"], start["pid_namespace"]) == (2, "501", 7, 3, 8, os.getpid(), str(namespace))


TORCHRUN_SCRIPT = """
import sys
from trainer_hook import TrainingMonitor
with TrainingMonitor(job="launch", pushgateway=False, record_path=sys.argv[1]) as monitor:
    monitor.log({"loss": 1.0})
"""


TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_every_rank_of_a_torchrun_launch_shares_one_run_and_launches_differ(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    runs = []
    for launch in range(2):
        out = tmp_path / f"launch{launch}"
        out.mkdir()
        subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), str(out)],
                       cwd=REPO, env=env, check=True, timeout=120, capture_output=True)
        starts = [record_lines(path)[1][0] for path in sorted(out.glob("*.jsonl"))]
        assert sorted((s["rank"], s["world_size"]) for s in starts) == [(0, 2), (1, 2)]
        assert len({s["run"] for s in starts}) == 1
        runs.append(starts[0]["run"])
    assert runs[0] != runs[1]


def test_a_resumed_run_continues_the_same_group_and_record(tmp_path, bare_env, start_service):
    """Restarted from a checkpoint under the same run id: one Pushgateway group, the step goes on,
    counters restart from 0 (a counter reset for rate()), the record gets a second start line."""
    pgw = start_service(processes.pushgateway(tmp_path))
    run = run_id("resume")
    for first, last in ((0, 9), (10, 14)):
        with TrainingMonitor(job="identity", run=run, pushgateway=pgw.url, rank=0,
                             record_path=tmp_path / "r.jsonl", push_interval=60) as m:
            for step in range(first, last + 1):
                m.log({"loss": 1.0}, step=step)
    assert pushed_value(pgw.url, "training_step", run) == 14
    assert pushed_value(pgw.url, "training_steps_total", run) == 5
    groups = requests.get(pgw.url + "/api/v1/metrics", timeout=5).json()["data"]
    assert len([g for g in groups if g["labels"].get("run") == run]) == 1
    steps, events = record_lines(tmp_path / "r.jsonl")
    assert [x["step"] for x in steps] == list(range(15))
    assert [e["event"] for e in events] == ["start", "end", "start", "end"]
