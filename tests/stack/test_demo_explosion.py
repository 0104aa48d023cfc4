"""The demo's exploding run (stack/demo_training.py: the learning rate jumps x1e4, the grad norm
spikes and the next step is Inf, milliseconds apart) fires TrainingGradientExplosion through the
real rules, naming the spike's step.

The run trains for real and pushes to a real Pushgateway; what the Pushgateway serves after each
push is what a scrape would see. The rules need 2 min of history before the spike, so the scrapes
are replayed to promtool 15 s apart (the default scrape interval): time is compressed, nothing else.
The spike and the Inf are ~10 ms apart and pushes 250 ms: they share a push (the case that used to
stay silent) but for the rare run where a push falls between them. Steps last at least 8 ms (the
demo sleeps out the rest), so 600 of them span at least 19 pushes on any machine, however idle.
"""
from __future__ import annotations

import json
import math
import subprocess
import threading
from pathlib import Path

import numpy as np
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from stack import demo_training, processes
from tests.support.paths import REPO
from trainer_hook.push import Pusher

EXPLODE_AT = 600
#: Series the rule and its description read.
READ_BY_THE_RULE = ("training_grad_norm_max", "training_grad_norm_max_step", "training_step",
                    "training_run_state", "training_nonfinite_steps_total", "training_first_nonfinite_step")
LABELS = 'job="demo",run="explode",rank="0",instance="node"'
RUNNING = ',state="running"'


def test_the_demo_explosion_fires_and_names_the_spike_step(tmp_path: Path, start_service, monkeypatch) -> None:
    pushgateway = start_service(processes.pushgateway(tmp_path))
    monkeypatch.setenv("DUALTRACK_DELETE_AFTER", "none")  # no wait for the group's deletion at exit
    monkeypatch.setenv("DUALTRACK_INSTANCE", "node")
    scrapes: list[dict[str, float]] = []
    lock = threading.Lock()
    push = Pusher.push

    def push_then_scrape(self: Pusher, snapshot) -> bool:
        pushed = push(self, snapshot)
        if pushed:
            text = requests.get(pushgateway.url + "/metrics", timeout=5).text
            with lock:
                scrapes.append(scrape(text))
        return pushed

    monkeypatch.setattr(Pusher, "push", push_then_scrape)
    record = tmp_path / "explode.jsonl"
    demo_training.train(demo_training.parse_args([
        "--pushgateway", pushgateway.url, "--run", "explode", "--learning-rate", "3e-2",
        "--explode-at", str(EXPLODE_AT), "--steps", str(EXPLODE_AT + 150), "--step-time", "0.008",
        "--push-interval", "0.25", "--record-path", str(record)]))

    steps = [json.loads(line) for line in record.read_text().splitlines()[1:-1]]
    norms = {s["step"]: float(s["values"]["grad_norm"]) for s in steps}  # "inf" in the record is Inf
    value, spike = max((norm, step) for step, norm in norms.items() if math.isfinite(norm))
    first_bad = next(s["step"] for s in steps if s.get("nonfinite"))
    assert first_bad == spike + 1  # the demo's explosion: a spike, then Inf at the next step
    shown = [i for i, seen in enumerate(scrapes) if seen.get("training_grad_norm_max") == value]
    assert shown, f"no scrape showed the spike {value:g} as training_grad_norm_max: " \
                  f"{sorted({seen.get('training_grad_norm_max') for seen in scrapes} - {None})[-2:]}"
    at = shown[0]
    assert at >= 13, f"only {at} pushes before the spike: the rule needs 2 min (8) + 5 of history"
    baseline = [seen["training_grad_norm_max"] for seen in scrapes[:at - 7] if "training_grad_norm_max" in seen]
    median = float(np.median(baseline))
    description = (f"Run explode (job demo, rank 0, host node): gradient norm reached {value:.4g} at step "
                   f"{spike}, {value / median:.3g}x its median over the 30 min before ({median:.4g})."
                   + (f" The run went non-finite from step {first_bad} on."
                      if scrapes[at].get("training_nonfinite_steps_total", 0) > 0 else ""))
    tests = tmp_path / "demo_test.yml"
    tests.write_text(yaml.safe_dump({
        "rule_files": [str(REPO / "rules" / "recording.yml"), str(REPO / "rules" / "alerts.yml")],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": "15s",
            "input_series": [{"series": f"{name}{{{LABELS}{RUNNING if name == 'training_run_state' else ''}}}",
                              "values": " ".join(number(seen.get(name)) for seen in scrapes)}
                             for name in READ_BY_THE_RULE],
            "alert_rule_test": [
                {"eval_time": f"{15 * (at - 1)}s", "alertname": "TrainingGradientExplosion"},
                {"eval_time": f"{15 * at}s", "alertname": "TrainingGradientExplosion", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "job": "demo", "run": "explode", "rank": "0",
                                   "instance": "node"},
                    "exp_annotations": {"summary": "Gradient explosion in run explode rank 0",
                                        "description": description,
                                        "runbook_url": "#traininggradientexplosion",
                                        "infra_cause": "none: the run reports no GPU; "
                                                       "dualtrack explain explode has the timeline.",
                                        "dashboard_url": ""}}]}]}]}))
    done = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def scrape(text: str) -> dict[str, float]:
    """The values the Pushgateway serves for the demo run (run_state: its `running` sample)."""
    seen = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("run") == "explode" and sample.name in READ_BY_THE_RULE \
                    and sample.labels.get("state", "running") == "running":
                seen[sample.name] = sample.value
    return seen


def number(value: float | None) -> str:
    """A promtool series value: `_` for no sample."""
    if value is None:
        return "_"
    return "NaN" if math.isnan(value) else repr(value).replace("inf", "Inf")
