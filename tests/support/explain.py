"""Backfilled runs for `dualtrack explain`: both tracks (the hook's training_* series and the
exporter's nvml_gpu_* series) of a run, with one fault injected, as OpenMetrics for promtool.

Each run has `ranks` ranks, one GPU each, sampled every SCRAPE seconds for `minutes`; the fault
starts at FAULT_AT seconds. Series names and labels are the live ones (docs/metrics.md, docs/hook.md).
"""
from __future__ import annotations

import subprocess
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import yaml

from stack import processes
from tests.support.paths import REPO

SCRAPE = 15.0
FAULT_AT = 1800.0
#: XID 79 comes this long before the first non-finite step in the "xid" scenario.
XID_LEAD = 45.0
NORMAL_STEP = 0.5
SM_CLOCK = 1.98e9
THROTTLE_REASONS = ("gpu_idle", "sw_power_cap", "hw_power_brake_slowdown", "hw_slowdown", "sw_thermal_slowdown",
                    "hw_thermal_slowdown")
SCENARIOS = ("healthy", "thermal", "xid", "co-tenant", "co-tenant-sync", "power", "starving", "nan-all", "model", "mig",
             "mig-oom", "gpu-lost", "fine-tune-spike", "replica", "lr-jump", "ddp-thermal")
#: The "mig" scenario is "xid" with the last rank on GPU instance 1 of a MIG GPU (its `MIG-…` uuid in
#: training_gpu_info; the exporter's series carry the parent's). In "mig-oom" that rank's GPU instance
#: (40 GiB) fills up and it runs out of memory at OOM_AT, its parent GPU far from full. Both list a
#: process of no run in the parent's other GPU instance. In "gpu-lost", the last rank's GPU
#: is lost at FAULT_AT (the exporter drops its series, counts the loss and XID 79) and the rank fails
#: LOST_FAIL seconds later. In "replica" the last rank's post-reduction grad norm differs from its peers'
#: from FAULT_AT (training_replica_divergent_steps_total), 2 min after an uncorrected ECC error on its GPU.
LOST_FAIL = 30.0
#: In "lr-jump" the learning rate of every rank jumps from LEARNING_RATE to JUMPED_RATE at FAULT_AT (the demo's
#: explosion): in that push the gradient norm spikes (SPIKE) at the step before the first non-finite one.
LEARNING_RATE = 0.03
JUMPED_RATE = 300.0
SPIKE = 80.0
#: The "model" scenario: a gradient spike on rank 0 at FAULT_AT, its loss scale collapsing at
#: SCALE_AT, and rank 1 running out of memory (its GPU full) at OOM_AT.
SCALE_AT = 2400.0
OOM_AT = 3000.0
#: The "scale-drift" scenario (not in SCENARIOS: it needs a run of DRIFT_MINUTES): rank 0's loss scale
#: halves every DRIFT_HALVING seconds, 1024x below its start after 80 min but never 1024x within an hour.
DRIFT_HALVING = 480.0
DRIFT_MINUTES = 150.0
#: Each rank trains in a container of its own: pid CONTAINER_PID in PID namespace container_namespace(rank),
#: host pid 1000 + rank; the co-tenant is a host process (HOST_NAMESPACE). In the "co-tenant" scenario
#: the last rank's neighbour computes (CO_TENANT_SM of the SMs, taken from the rank's process); rank 0's
#: GPU holds an idle one (IDLE_NEIGHBOUR) all along.
CONTAINER_PID = 7
TRAINING_SM = 0.9
CO_TENANT_SM = 0.4
IDLE_NEIGHBOUR = ("5151", "jupyter", 2 * 2**30)
#: In "co-tenant-sync" the last rank's neighbour computes from FAULT_AT and, training being synchronous,
#: every rank's step time is 1.22 or 1.27 times as long, in turns (a 22-27 % slowdown).
SYNC_SLOWDOWNS = (1.22, 1.27)
#: In "power" the last rank's GPU is power-capped (sw_power_cap) and power-braked (hw_power_brake_slowdown),
#: each POWER_SHARE of the time, from 10 min before FAULT_AT; every rank's step time goes to 0.8 s at FAULT_AT.
POWER_SHARE = 0.045
HOST_NAMESPACE = 4026531836
#: In "co-tenant-uid" every rank's step time is UID_SLOWDOWN times as long from FAULT_AT, a neighbour in
#: another uid's container holding CO_TENANT_BYTES["co-tenant-uid"] on the last rank's GPU.
UID_SLOWDOWN = 1.25
CO_TENANT_BYTES = {"co-tenant-uid": 14 * 2**30}


@dataclass(frozen=True)
class Identity:
    """A process as the hook reports it (training_process_info's labels but hostname) and as the
    exporter names it (its per-process series' labels but the GPU's)."""

    hook: str
    exporter: str


def host_process(pid: str, name: str) -> str:
    """The exporter's labels of a host process, its PID namespace read."""
    return (f'pid="{pid}",process="{name}",container_id="",pod_uid="",slurm_job_id="",'
            f'pid_namespace="{HOST_NAMESPACE}",namespace_pid="{pid}"')


def default_identities(rank: int) -> dict[str, Identity]:
    """The rank's process (pid CONTAINER_PID in container_namespace(rank), host pid 1000 + rank) and
    the host co-tenant (4242), named by PID namespace, as an exporter and hook without start times do."""
    inner = f'pid_namespace="{container_namespace(rank)}",namespace_pid="{CONTAINER_PID}"'
    return {"rank": Identity(f'pid="{CONTAINER_PID}",pid_namespace="{container_namespace(rank)}"',
                             f'pid="{1000 + rank}",process="python3",container_id="",pod_uid="",slurm_job_id="",'
                             f'{inner}'),
            "co-tenant": Identity("", host_process("4242", "stress-ng"))}
#: "ddp-thermal" is "thermal" under DDP with the collectives timed: every rank waits COLLECTIVE_SHARE of its
#: step time in the all-reduce until FAULT_AT; then the throttled last rank still does, and the others wait
#: for it too (0.3 s of each 0.8 s step).
COLLECTIVE_SHARE = 0.02


def container_namespace(rank: int) -> int:
    return 4026532500 + rank


@dataclass
class Rank:
    step_seconds: float = NORMAL_STEP
    wait_share: float = 0.0
    thermal: bool = False
    power_share: float = 0.0  # of the time in each power reason
    co_tenant: bool = False
    idle_neighbour: bool = False
    nonfinite_from: float | None = None  # time (s from start) of the first non-finite step
    failed_at: float | None = None
    grad_norm: float = 1.0
    loss_scale: float = 65536.0
    ooms: int = 0
    memory_full: bool = False
    lost: bool = False
    divergent: int = 0  # replica comparisons this rank lost
    ecc: int = 0  # uncorrected ECC errors of its GPU
    learning_rate: float = LEARNING_RATE
    collective_share: float | None = None  # of the step time waited in the collectives (None: not timed)


def uuid_of(run: str, rank: int) -> str:
    """The uuid of the GPU the rank's exporter series carry (a MIG rank's parent GPU)."""
    return f"GPU-{zlib.crc32(run.encode()):08x}-{rank:04d}-4000-8000-{rank:012d}"


def hook_uuid_of(scenario: str, run: str, rank: int, ranks: int) -> str:
    """The uuid the rank's hook reports: its MIG instance's in the "mig" scenario's last rank."""
    uuid = uuid_of(run, rank)
    return f"MIG-{uuid[4:]}" if scenario in ("mig", "mig-oom") and rank == ranks - 1 else uuid


def rank_state(scenario: str, rank: int, at: float, ranks: int) -> Rank:
    """What rank `rank` of a run of `scenario` does `at` seconds after its start."""
    state = Rank()
    faulty = rank == ranks - 1  # the last rank's GPU is the one that misbehaves
    after = at >= FAULT_AT
    if scenario == "ddp-thermal":
        state.collective_share = COLLECTIVE_SHARE + (0.3 / 0.8 if after and not faulty else 0.0)
    if scenario in ("thermal", "ddp-thermal") and after:
        state.step_seconds = 0.8  # synchronous training: every rank waits for the throttled GPU
        state.thermal = faulty
    elif scenario in ("xid", "mig") and faulty:
        state.nonfinite_from = FAULT_AT + XID_LEAD
        state.failed_at = FAULT_AT + XID_LEAD + 60
    elif scenario == "gpu-lost" and faulty:
        state.lost, state.failed_at = after, FAULT_AT + LOST_FAIL
    elif scenario == "co-tenant" and after and faulty:
        state.step_seconds, state.co_tenant = 1.0, True
    elif scenario == "co-tenant-uid" and after:
        state.step_seconds, state.co_tenant = NORMAL_STEP * UID_SLOWDOWN, faulty
    elif scenario == "co-tenant-sync" and after:
        state.step_seconds = NORMAL_STEP * SYNC_SLOWDOWNS[int(at // SCRAPE) % 2]
        state.co_tenant = faulty
    elif scenario == "power":
        state.step_seconds = 0.8 if after else NORMAL_STEP
        state.power_share = POWER_SHARE if faulty and at >= FAULT_AT - 600 else 0.0
    elif scenario == "co-tenant" and rank == 0:
        state.idle_neighbour = True
    elif scenario == "starving" and after:
        state.step_seconds, state.wait_share = 1.25, 0.6
    elif scenario == "nan-all":
        state.nonfinite_from = FAULT_AT
    elif scenario == "model" and rank == 0:
        state.grad_norm = 80.0 if FAULT_AT <= at < FAULT_AT + SCRAPE else 1.0
        state.loss_scale = 32.0 if at >= SCALE_AT else 65536.0
    elif scenario == "scale-drift" and rank == 0:
        state.loss_scale = 65536.0 / 2 ** int(at // DRIFT_HALVING)
    elif scenario == "lr-jump" and after:
        state.learning_rate, state.nonfinite_from = JUMPED_RATE, FAULT_AT
        state.grad_norm = SPIKE if at < FAULT_AT + SCRAPE else 1.0  # the run rolls back and carries on
    elif scenario == "fine-tune-spike" and rank == 0:  # norms around 5e-5, one spike 20x above
        state.grad_norm = 1e-3 if FAULT_AT <= at < FAULT_AT + SCRAPE else 5e-5
    elif scenario == "replica" and faulty:
        state.divergent = int(after) * (1 + int((at - FAULT_AT) // SCRAPE))
        state.ecc = int(at >= FAULT_AT - 120)
    elif scenario in ("model", "mig-oom") and rank == ranks - 1:
        state.memory_full = at >= OOM_AT - 120
        state.ooms = int(at >= OOM_AT)
    return state


def training_samples(scenario: str, rank: int, ranks: int, minutes: float, scrape: float = SCRAPE):
    """(seconds from the start, the rank's state, its run state, its training_* values) at each scrape:
    what the hook's pushes carry (the time series of its start and last update left to the caller)."""
    steps = waited = wall = collective = 0.0
    first_nonfinite, nonfinite_steps, state = -1.0, 0, "running"
    at = 0.0
    while at <= minutes * 60:
        now = rank_state(scenario, rank, at, ranks)
        if state == "running":
            if now.failed_at is not None and at >= now.failed_at:
                state = "failed"
            else:
                steps += scrape / now.step_seconds
                waited += scrape * now.wait_share
                wall += scrape
                collective += scrape * (now.collective_share or 0.0)
        spike_step = int(steps)
        if now.nonfinite_from is not None and at >= now.nonfinite_from and first_nonfinite < 0:
            first_nonfinite = float(int(steps))
            if scenario == "lr-jump":
                spike_step -= 1  # the spike, then the first non-finite step, in one push
        if first_nonfinite >= 0 and state == "running":
            nonfinite_steps += int(scrape / now.step_seconds)
        values = {
            "training_step": int(steps), "training_steps_total": int(steps), "training_data_wait_seconds_total": waited,
            "training_first_nonfinite_step": first_nonfinite, "training_nonfinite_steps_total": nonfinite_steps,
            "training_grad_norm_max": now.grad_norm * (1 + 0.1 * ((int(at) // 15) % 3)),
            "training_loss_scale": now.loss_scale, "training_cuda_ooms_total": now.ooms,
            "training_grad_norm_max_step": spike_step, "training_world_size": ranks,
            "training_learning_rate": now.learning_rate}
        if now.collective_share is not None:  # collectives timed (DDP)
            values["training_step_duration_seconds_sum"] = wall
            values["training_collective_wait_seconds_total"] = collective
        yield at, now, state, values
        at += scrape


def write_run(out: IO[str], scenario: str, run: str, base: float, ranks: int = 2, minutes: float = 60,
              job: str = "train", scrape: float = SCRAPE, gpu_job: str = "dualtrack-exporter",
              identities: Callable[[int], dict[str, Identity]] = default_identities) -> int:
    """Write the run's samples (time-ordered per series) to `out`; returns the number of samples. The GPU
    series are the exporter's job's, or `gpu_job`'s (as someone pushing or remote-writing them would).
    `identities(rank)` names the rank's process and the co-tenant on its GPU."""
    samples = 0
    for rank in range(ranks):
        named = identities(rank)
        uuid, hook_uuid = uuid_of(run, rank), hook_uuid_of(scenario, run, rank, ranks)
        host = f"{run}-node{rank // 8}"
        train = f'job="{job}",run="{run}",rank="{rank}",instance="{host}"'
        gpu = f'job="{gpu_job}",instance="{host}:9942",gpu="{rank % 8}",uuid="{uuid}"'
        thermal = idle = power = 0.0
        lines: list[str] = []
        for at, now, state, values in training_samples(scenario, rank, ranks, minutes, scrape):
            ts = f" {base + at:.3f}"
            values["training_start_timestamp_seconds"] = base
            values["training_last_update_timestamp_seconds"] = base + at
            for name, value in values.items():
                lines.append(f"{name}{{{train}}} {value}{ts}")
            nonfinite = values["training_nonfinite_steps_total"]
            lines.append(f'training_nonfinite_values_total{{{train},key="loss"}} {nonfinite}{ts}')
            for option in ("running", "finished", "failed"):
                lines.append(f'training_run_state{{{train},state="{option}"}} {int(option == state)}{ts}')
            lines.append(f'training_gpu_info{{{train},gpu="{rank % 8}",uuid="{hook_uuid}"}} 1{ts}')
            lines.append(f'training_process_info{{{train},hostname="{host}",{named["rank"].hook}}} 1{ts}')
            # What rules/recording.yml records: the rank's exporter GPU (a MIG instance's parent).
            mig = f',gpu_instance="1",mig_uuid="{hook_uuid}"' if hook_uuid != uuid else ""
            joined = f'{train},gpu="{rank % 8}",uuid="{uuid}"{mig}'
            lines.append(f"job_run_rank_gpu:training_gpu_info:nvml{{{joined}}} 1{ts}")
            lines.append(f"nvml_gpu_lost{{{gpu}}} {int(now.lost)}{ts}")
            if now.lost:  # the exporter drops a lost GPU's series
                lines.append(f"nvml_exporter_gpu_lost_total{{{gpu}}} 1{ts}")
                lines.append(f'nvml_gpu_xid_errors_total{{{gpu},xid="79"}} 1{ts}')
                continue
            if mig:
                lines.append(f'nvml_gpu_mig_info{{{gpu},gpu_instance="1",mig_uuid="{hook_uuid}"}} 1{ts}')
            thermal += scrape if now.thermal else 0.0
            power += scrape * now.power_share
            idle += scrape * now.wait_share
            for reason in THROTTLE_REASONS:
                value = {"sw_thermal_slowdown": thermal, "gpu_idle": idle, "sw_power_cap": power,
                         "hw_power_brake_slowdown": power}.get(reason, 0.0)
                lines.append(f'nvml_gpu_throttle_seconds_total{{{gpu},reason="{reason}"}} {value}{ts}')
            clock = SM_CLOCK * (0.6 if now.thermal else 1.0)
            lines.append(f'nvml_gpu_clock_hertz{{{gpu},clock="sm"}} {clock}{ts}')
            neighbour = CO_TENANT_BYTES.get(scenario, 12 * 2**30) if now.co_tenant else 0
            used = 79 * 2**30 if now.memory_full and not mig else 61 * 2**30 + neighbour \
                + (IDLE_NEIGHBOUR[2] if now.idle_neighbour else 0)
            if mig:
                lines.append(f'nvml_gpu_mig_memory_used_bytes{{{gpu},gpu_instance="1"}} '
                             f'{(39.5 if now.memory_full else 20) * 2**30}{ts}')
                lines.append(f'nvml_gpu_mig_memory_total_bytes{{{gpu},gpu_instance="1"}} {40 * 2**30}{ts}')
            lines.append(f"nvml_gpu_memory_used_bytes{{{gpu}}} {used}{ts}")
            lines.append(f"nvml_gpu_memory_total_bytes{{{gpu}}} {80 * 2**30}{ts}")
            lines.append(f"nvml_gpu_utilization_ratio{{{gpu}}} {0.93 * (1 - now.wait_share)}{ts}")
            lines.append(f'nvml_gpu_ecc_errors_total{{{gpu},error="uncorrected"}} {now.ecc}{ts}')
            if scenario == "starving":  # a 2-min checkpoint pause, 10 min before the starvation
                paused = min(max(0.0, at - (FAULT_AT - 600)), 120.0)
                lines.append(f'training_paused_seconds_total{{{train},reason="checkpoint"}} {paused}{ts}')
            if scenario == "replica":
                lines.append(f"training_replica_divergent_steps_total{{{train}}} {now.divergent}{ts}")
            # NVML names the host pid; the exporter adds its PID namespace and its pid in it
            computing = TRAINING_SM * (1 - now.wait_share) - (CO_TENANT_SM if now.co_tenant else 0.0)
            processes = [(named["rank"].exporter, 61 * 2**30, computing)]
            if mig:  # a server in the parent's other GPU instance: isolated from the rank's, no co-tenant
                processes.append((host_process("4343", "tritonserver"), 10 * 2**30, 0.3))
            if now.co_tenant:
                processes.append((named["co-tenant"].exporter, CO_TENANT_BYTES.get(scenario, 12 * 2**30), CO_TENANT_SM))
            if now.idle_neighbour:
                processes.append((host_process(*IDLE_NEIGHBOUR[:2]), IDLE_NEIGHBOUR[2], 0.0))
            for labels, used, sm in processes:
                process = f"{gpu},{labels}"
                lines.append(f"nvml_gpu_process_memory_used_bytes{{{process}}} {used}{ts}")
                lines.append(f"nvml_gpu_process_sm_utilization_ratio{{{process}}} {sm}{ts}")
            if scenario in ("xid", "mig") and rank == ranks - 1 and at >= FAULT_AT:
                lines.append(f'nvml_gpu_xid_errors_total{{{gpu},xid="79"}} 1{ts}')
        out.write("\n".join(lines) + "\n")
        samples += len(lines)
    # What rules/goodput.yml records for the run while it runs (the rules are tested by promtool).
    lines = []
    at = 0.0
    while at <= minutes * 60:
        states = [rank_state(scenario, rank, at, ranks) for rank in range(ranks)]
        shares = [0.0 if s.failed_at is not None and at >= s.failed_at else 1 - s.wait_share for s in states]
        goodput = f'job_run:training_goodput:ratio_rate5m{{job="{job}",run="{run}"}}'
        lines.append(f"{goodput} {sum(shares) / ranks} {base + at:.3f}")
        at += scrape
    out.write("\n".join(lines) + "\n")
    return samples + len(lines)


def backfill(scenarios: dict[str, str], base: float, data: Path, workdir: Path, ranks: int = 2,
             minutes: float = 60, scrape: float = SCRAPE, gpu_jobs: dict[str, str] | None = None,
             identities: dict[str, Callable[[int], dict[str, Identity]]] | None = None) -> int:
    """Write {run: scenario} into OpenMetrics and build TSDB blocks in `data`; returns samples. `gpu_jobs`
    ({run: job}) writes a run's GPU series under another job than the exporter's; `identities` names a
    run's processes (default_identities for the runs it does not list)."""
    source = workdir / "explain.om"
    samples = 0
    with open(source, "w", encoding="utf-8") as out:
        for run, scenario in scenarios.items():
            samples += write_run(out, scenario, run, base, ranks, minutes, scrape=scrape,
                                 gpu_job=(gpu_jobs or {}).get(run, "dualtrack-exporter"),
                                 identities=(identities or {}).get(run, default_identities))
        out.write("# EOF\n")
    data.mkdir(parents=True, exist_ok=True)
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(source), str(data)],
                   check=True, capture_output=True, timeout=600)
    source.unlink()
    return samples


def infra_cause_rule() -> str:
    """The expression of rules/explain.yml's job_run_rank:training_infra_cause:score."""
    rules = yaml.safe_load((REPO / "rules" / "explain.yml").read_text())
    (expr,) = [rule["expr"] for group in rules["groups"] for rule in group["rules"]
               if rule.get("record") == "job_run_rank:training_infra_cause:score"]
    return expr


@contextmanager
def serving(work: Path) -> Iterator[str]:
    """A real Prometheus over the blocks in `work`/prometheus-data (backfill's `data`, if any): its URL."""
    config = work / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1h}\n")
    service = processes.prometheus(work, config).start()
    try:
        yield service.url
    finally:
        service.stop()
