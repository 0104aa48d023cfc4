"""Every dashboard query returns data from a real Prometheus fed by the real exporter and a real run.

The exporter runs simulated GPUs; the demo training run (real torch, trainer_hook) trains on one of
them (its uuid passed as --gpu-uuid, as the hook reports on a real GPU) and pushes to a real
Pushgateway. Grafana's variables are resolved the way Grafana does (label_values over the series
API), then each panel query and annotation runs against Prometheus.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from dualtrack.prometheus import Prometheus
from stack import processes
from tests.support import daemons
from tests.support.dashboards import (
    DASHBOARDS,
    HOOK_METRICS,
    PROMETHEUS_METRICS,
    label_values_args,
    load,
    metric_names,
    queries,
    query_variables,
    recording_rule_names,
    substitute,
)
from tests.support.exporter import faulty_exporter
from tests.support.namespaces import UNSHARE
from tests.support.paths import REPO
from tests.support.process import children
from trainer_hook.connection import Endpoint

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

JOB, RUN = "dashboards-e2e", "mlp-e2e"
MIG_RUN = "mlp-e2e-mig"  # trains on GPU instance 1 of GPU 1, which is in MIG mode
# Grafana's own variables at a 1 s scrape interval ($__rate_interval >= 4 scrape intervals).
BUILTINS = {"__rate_interval": "5s", "__interval": "1s", "__range": "1m"}
# Used by the dashboards but absent on the simulated H100s, with the reason.
NOT_ON_H100 = {"nvml_gpu_retired_pages_total": "pre-Ampere GPUs retire pages; H100s remap rows"}
# Queries that need a real GPU: the hook reads the CUDA caching allocator only where CUDA is
# initialised.
NEEDS_REAL_GPU = {
    "Model · CUDA memory allocated vs reserved A": "training_cuda_memory_allocated_bytes",
    "Model · CUDA memory allocated vs reserved B": "training_cuda_memory_reserved_bytes",
    "Model · Allocator retries and OOMs A": "training_cuda_alloc_retries_total",
    "Model · Allocator retries and OOMs B": "training_cuda_ooms_total",
}
# Queries for runs that log their max_steps: the run here trains until stopped.
NEEDS_MAX_STEPS = {"ETA A": "job_run:training_eta_seconds:rate5m needs training_max_steps"}
# Queries for what this run (one process, no DDP model, never inside monitor.paused()) does not do.
NEEDS_DDP_OR_PAUSE = {
    "Model · Data-wait share B": "job_run_rank:training_collective_wait:ratio2m needs a DDP model's timed collectives",
    "Paused, by reason A": "job_run:training_paused:ratio_rate5m needs monitor.paused()",
    "Replica divergence A": "training_replica_divergent_steps_total needs DDP replicas compared",
}
# GPU 1 gets fans (SXM H100s have none) and MIG mode (MIG_RUN trains on its GPU instance 1); GPU 0,
# the run's GPU, reports an XID 79 (GPUXidError).
FAULT_PLAN = {"devices": {"1": {"fans": 2, "mig": True}}, "faults": [{"gpu": 0, "xid": 79, "at": 1, "times": 1}]}
MIG_ONLY = 'gpu_instance!=""'  # a query of the MIG run's GPU instance: empty for RUN (checked with MIG_RUN)


class Stack:
    """Pushgateway, simulated exporter, Prometheus (1 s scrape/eval, repo rules) and a demo run."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.services: list[processes.Service] = []

    def start(self) -> Stack:
        self.pgw = self._start(processes.pushgateway(self.workdir))
        faults = self.workdir / "faults.json"
        faults.write_text(json.dumps(FAULT_PLAN))
        gpu_processes = self.workdir / "gpu-processes"  # GPU 0 runs RUN's process (GPU 1, in MIG mode, hides its)
        self.exporter = self._start(faulty_exporter(
            self.workdir, ["--simulate=demo", "--simulate.gpus=2", "--sample-interval=0.2", f"--faults={faults}",
                           f"--simulate.processes={gpu_processes}"]))
        config = processes.render_prometheus_config(
            self.workdir, {processes.EXPORTER_JOB: [self.exporter.address],
                           processes.PUSHGATEWAY_JOB: [self.pgw.address]},
            scrape_interval="1s", evaluation_interval="1s")
        self.prom = self._start(processes.prometheus(self.workdir, config))
        self.uuid = daemons.wait_for_series(self.prom.url, 'nvml_gpu_info{gpu="0"}', 30)[0]["metric"]["uuid"]
        mig = daemons.wait_for_series(self.prom.url, 'nvml_gpu_mig_info{gpu="1",gpu_instance="1"}', 30)[0]
        self.parent_uuid, self.mig_uuid = mig["metric"]["uuid"], mig["metric"]["mig_uuid"]
        self._start(processes.Service(
            "training-mig", [sys.executable, "-m", "stack.demo_training", "--pushgateway", self.pgw.url,
                             "--job", JOB, "--run", MIG_RUN, "--steps", "0", "--step-time", "0.1",
                             "--push-interval", "0.5", "--learning-rate", "0.02", "--gpu-uuid", self.mig_uuid,
                             "--record-path", str(self.workdir / "record-mig.jsonl")],
            0, self.workdir / "training-mig.log", ready_path=None,
            env={**os.environ, "PYTHONPATH": str(REPO)}))
        # Trains until the fixture stops it: a slow-loader phase, then an explosion (a NaN step). In a
        # PID namespace of its own, as in a container: the run's process panel joins it on the pair
        # (its namespace, its pid there), not on the host pid NVML lists.
        training = self._start(processes.Service(
            "training", [*UNSHARE, sys.executable, "-m", "stack.demo_training", "--pushgateway", self.pgw.url,
                         "--job", JOB, "--run", RUN, "--steps", "0", "--step-time", "0.05",
                         "--push-interval", "0.5", "--input-bound", "40:80", "--data-delay", "0.05",
                         "--explode-at", "150", "--grad-scaler", "--gpu-uuid", self.uuid,
                         "--record-path", str(self.workdir / "record.jsonl")],
            0, self.workdir / "training.log", ready_path=None,
            env={**os.environ, "PYTHONPATH": str(REPO)}))
        [self.trainer] = processes.wait_until(lambda: children(training.proc.pid), 10,
                                              what="the training unshare forked")
        gpu_processes.write_text(f"0 {self.trainer}\n")
        return self

    def _start(self, service: processes.Service) -> processes.Service:
        self.services.append(service)
        return service.start()

    def stop(self) -> None:
        if any(s.name == "training" and s.running() for s in self.services):  # so its child runs too
            os.kill(self.trainer, signal.SIGKILL)  # unshare --fork ignores SIGTERM; it exits with its child
        for service in reversed(self.services):  # the training run first
            service.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("dashboards-e2e"))
    try:
        yield stack.start()
    finally:
        stack.stop()


def label_values(prom_url: str, selector: str, label: str) -> list[str]:
    """What Grafana's label_values(selector, label) lists: the label's values among matching series."""
    response = requests.get(f"{prom_url}/api/v1/series", params={"match[]": selector}, timeout=5)
    response.raise_for_status()
    return sorted({series[label] for series in response.json()["data"] if label in series})


def regex_literal(value: str) -> str:
    """`value` as a regex inside a PromQL string, escaped the way Grafana escapes variable values."""
    return re.escape(value).replace("\\", "\\\\")


def label_names(prom_url: str, selector: str) -> list[str]:
    """What Grafana's label_names(selector) lists: the label names of the matching series."""
    response = requests.get(f"{prom_url}/api/v1/labels", params={"match[]": selector}, timeout=5)
    response.raise_for_status()
    return sorted(response.json()["data"])


def variable_regex(variable: dict) -> re.Pattern:
    """The variable's `regex` filter (a /JavaScript/ regex; these ones read the same in Python)."""
    return re.compile(variable.get("regex", "").strip("/") or ".*")


def resolve_variables(prom_url: str, dashboard: dict, chosen: dict[str, str]) -> dict[str, str]:
    """Each variable's value in order: the `chosen` value (which must be offered), else all values
    (a single-value variable: the first, as Grafana picks)."""
    values: dict[str, str] = {}
    for variable in query_variables(dashboard):
        selector, label = label_values_args(substitute(variable["query"], values))
        selector = substitute(selector, {**BUILTINS, **values})
        listed = label_values(prom_url, selector, label) if label else label_names(prom_url, selector)
        offered = [v for v in listed if variable_regex(variable).fullmatch(v)]
        assert offered, f"{dashboard['uid']}: variable {variable['name']} lists no values"
        if variable["name"] in chosen:
            assert chosen[variable["name"]] in offered, (variable["name"], offered)
            values[variable["name"]] = chosen[variable["name"]] if label is None else \
                regex_literal(chosen[variable["name"]])
        elif not variable["multi"]:
            values[variable["name"]] = offered[0] if label is None else regex_literal(offered[0])
        else:  # "All" of a multi-value variable: Grafana sends the escaped values as an alternation
            values[variable["name"]] = "|".join(regex_literal(v) for v in offered)
    return values


def empty_panel_queries(prom_url: str, dashboard: dict, values: dict[str, str]) -> list[str]:
    """'panel refId: expr' of every panel query that returns an empty vector right now, but those
    that wait for merged names or need CUDA."""
    return [f"{where} {target['refId']}: {expr}" for where, expr, target in queries(dashboard)
            if not where.startswith("annotation ")
            and f"{where} {target['refId']}" not in NEEDS_REAL_GPU | NEEDS_MAX_STEPS | NEEDS_DDP_OR_PAUSE
            and MIG_ONLY not in expr
            and not daemons.query(prom_url, substitute(expr, {**BUILTINS, **values}))]


TRAINING_CHOICES = {"job": JOB, "run": RUN, "hparam": "learning_rate", "hvalue": "0.01"}


def run_started(stack: Stack) -> None:
    daemons.wait_for_series(stack.prom.url, f'training_step{{job="{JOB}"}} > 20', 60)


def test_every_panel_query_returns_data(stack):
    run_started(stack)
    for path in DASHBOARDS:
        dashboard = load(path)
        values = resolve_variables(stack.prom.url, dashboard,
                                   {**TRAINING_CHOICES, "gpu": stack.uuid} if "training" in path.stem else {})
        try:
            processes.wait_until(lambda dashboard=dashboard, values=values:
                                 not empty_panel_queries(stack.prom.url, dashboard, values),
                                 30, interval=1, what="every panel query to return data")
        except TimeoutError:
            pass  # reported below, with the panel titles
        assert empty_panel_queries(stack.prom.url, dashboard, values) == [], path.name
        # The exceptions stay honest: a query listed as waiting that returns data must leave the list.
        answered = [f"{where} {target['refId']}" for where, expr, target in queries(dashboard)
                    if f"{where} {target.get('refId')}" in NEEDS_REAL_GPU | NEEDS_MAX_STEPS | NEEDS_DDP_OR_PAUSE
                    and daemons.query(stack.prom.url, substitute(expr, {**BUILTINS, **values}))]
        assert answered == [], "these queries return data now: remove them from their NEEDS_ list"


def test_run_panels_show_the_run_on_its_gpu_only(stack):
    """The Infra track follows the run's GPU (joined on uuid), not every GPU of the host."""
    run_started(stack)
    dashboard = load(next(p for p in DASHBOARDS if p.stem == "training-run"))
    values = resolve_variables(stack.prom.url, dashboard, {**TRAINING_CHOICES, "gpu": stack.uuid})
    panel = next(p for p in dashboard["panels"] if p["title"] == "Infra · Power vs limit")
    series = daemons.query(stack.prom.url, substitute(panel["targets"][0]["expr"], {**BUILTINS, **values}))
    assert {s["metric"]["uuid"] for s in series} == {stack.uuid}
    table = next(p for p in dashboard["panels"] if p["type"] == "table")
    rows = daemons.query(stack.prom.url, substitute(table["targets"][0]["expr"], {**BUILTINS, **values}))
    assert [(row["metric"]["run"], row["metric"]["learning_rate"]) for row in rows] == [(RUN, "0.01")]


def test_alert_annotations_mark_the_run_and_its_gpu(stack):
    """The run's non-finite step and its GPU's XID fire alerts that the two annotation queries find."""
    run_started(stack)
    dashboard = load(next(p for p in DASHBOARDS if p.stem == "training-run"))
    values = resolve_variables(stack.prom.url, dashboard, {**TRAINING_CHOICES, "gpu": stack.uuid})
    expected = {"Run alerts": "TrainingLossNonFinite", "GPU alerts": "GPUXidError"}
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            firing = daemons.wait_for_series(
                stack.prom.url, substitute(annotation["expr"], {**BUILTINS, **values}), 60)
            assert expected[annotation["name"]] in {a["metric"]["alertname"] for a in firing}


def test_a_mig_run_shows_its_gpu_instance_and_its_parent_gpu(stack):
    """A run on a MIG slice reports a MIG-… uuid that no exporter series carries: its Infra track shows
    its GPU instance's series and its parent GPU's, and its idle share is recorded."""
    daemons.wait_for_series(stack.prom.url, f'training_step{{run="{MIG_RUN}"}} > 5', 60)
    dashboard = load(next(p for p in DASHBOARDS if p.stem == "training-run"))
    values = resolve_variables(stack.prom.url, dashboard, {**TRAINING_CHOICES, "run": MIG_RUN, "hvalue": "0.02",
                                                           "gpu": stack.mig_uuid})
    mig = [(f"{where} {target['refId']}", substitute(expr, {**BUILTINS, **values}))
           for where, expr, target in queries(dashboard) if MIG_ONLY in expr]
    assert len(mig) >= 5
    processes.wait_until(lambda: all(daemons.query(stack.prom.url, expr) for _, expr in mig), 60,
                         interval=1, what="every MIG query of the MIG run to return data")
    for where, expr in mig:
        series = daemons.query(stack.prom.url, expr)
        assert {(s["metric"].get("uuid"), s["metric"].get("gpu_instance"), s["metric"].get("run"))
                for s in series} <= {(stack.parent_uuid, "1", MIG_RUN), (None, None, MIG_RUN)}, where
    panel = next(p for p in dashboard["panels"] if p["title"] == "Infra · Power vs limit")
    power = daemons.query(stack.prom.url, substitute(panel["targets"][0]["expr"], {**BUILTINS, **values}))
    assert {(s["metric"]["uuid"], s["metric"]["run"]) for s in power} == {(stack.parent_uuid, MIG_RUN)}
    idle = daemons.wait_for_series(
        stack.prom.url, f'job_run_rank_gpu:nvml_gpu_idle_seconds:rate5m{{run="{MIG_RUN}"}}', 30)
    assert [(s["metric"]["uuid"], s["metric"]["gpu_instance"], s["metric"]["mig_uuid"]) for s in idle] == [
        (stack.parent_uuid, "1", stack.mig_uuid)]


def exposed_names(url: str) -> set[str]:
    """Sample names a /metrics page can carry, from its HELP/TYPE lines (even for families without samples)."""
    names = set()
    for family in text_string_to_metric_families(requests.get(url, timeout=5).text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "info": ["_info"]}.get(family.type, [""])
        names.update(family.name + suffix for suffix in suffixes)
        names.update(sample.name for sample in family.samples)
    return names


def test_dashboards_use_only_metrics_the_exporter_and_hook_expose(stack):
    run_started(stack)
    exposed = exposed_names(stack.exporter.url + "/metrics") | exposed_names(stack.pgw.url + "/metrics")
    used = {name for path in DASHBOARDS for _, expr, _ in queries(load(path)) for name in metric_names(expr)}
    used -= PROMETHEUS_METRICS | recording_rule_names()
    needs_gpu = {name for path in DASHBOARDS for where, expr, target in queries(load(path))
               if f"{where} {target.get('refId')}" in NEEDS_REAL_GPU | NEEDS_DDP_OR_PAUSE
               for name in metric_names(expr)}
    assert used - exposed - needs_gpu == set(NOT_ON_H100)
    # The contract list in test_dashboards stays honest: the hook really pushes what it names.
    assert {"training_loss_max", "training_grad_norm_max", "training_gpu_info", "training_run_info"} <= exposed
    assert not {n for n in used if n.startswith("training_")} - HOOK_METRICS


def test_a_gpu_belongs_to_the_run_only_while_the_run_is_live_on_it(stack):
    """Runs last in this module: ends the run. Its GPU's series leave the run's Infra panels when it
    ends, though the exporter keeps serving that GPU (and the hook's last push may linger)."""
    run_started(stack)
    dashboard = load(next(p for p in DASHBOARDS if p.stem == "training-run"))
    values = resolve_variables(stack.prom.url, dashboard, {**TRAINING_CHOICES, "gpu": stack.uuid})
    panel = next(p for p in dashboard["panels"] if p["title"] == "Infra · Power vs limit")
    expr = substitute(panel["targets"][0]["expr"], {**BUILTINS, **values})
    assert daemons.query(stack.prom.url, expr)
    training = next(s for s in stack.services if s.name == "training")
    ended = time.time()
    os.kill(stack.trainer, signal.SIGINT)  # the run closes its monitor: state leaves "running" (unshare then exits)
    training.proc.wait(30)
    processes.wait_until(lambda: not daemons.query(stack.prom.url, expr), 30, interval=0.5,
                         what="the ended run's Infra panel to empty")
    assert daemons.query(stack.prom.url, f'nvml_gpu_power_usage_watts{{uuid="{stack.uuid}"}}')
    matrix = Prometheus(Endpoint(stack.prom.url), timeout=5).query_range(expr, ended - 20, time.time(), 1)
    times = [t for series in matrix for t, _ in series["values"]]
    assert times and min(times) < ended, "the run's GPU showed while it ran"
    assert max(times) < ended + 10, "and not after it ended"
