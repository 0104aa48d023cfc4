"""One bad push must not blank every run: compose, Kubernetes and the no-Docker stack run the Pushgateway
with its consistency check (no --push.disable-consistency-check), so a push whose metric type conflicts
with what the gateway holds is refused with 400 and every other run's series stay scrapeable. Without
the check Pushgateway 1.5.1 takes that push (202) and answers 500 on /metrics for every group until the
bad group is deleted. The check limits one gateway to 170 ranks (docs/scaling.md); beyond that the
hook writes to a remote-write store instead."""
from __future__ import annotations

import time

import requests

from stack import processes
from tests.support.daemons import query, wait_for_rule_evaluations, wait_for_series
from tests.support.deploy import find, services

FLAG = "--push.disable-consistency-check"


def test_compose_and_kubernetes_keep_the_consistency_check():
    assert FLAG not in services()["pushgateway"]["command"]
    container = find("Deployment", "pushgateway")["spec"]["template"]["spec"]["containers"][0]
    assert FLAG not in container["args"]


def test_a_conflicting_push_is_refused_and_every_run_stays_scrapeable(tmp_path, start_service):
    """A rank's gauge, then another pusher's counter of the same name: the second push gets 400, and
    /metrics still serves the first run (with the flag: 202, then /metrics 500 for everyone)."""
    pgw = start_service(processes.pushgateway(tmp_path))
    assert FLAG not in pgw.argv
    good = requests.put(f"{pgw.url}/metrics/job/train/run/r1/rank/0",
                        data="# TYPE training_step gauge\ntraining_step 7\n", timeout=10)
    assert good.status_code == 200, good.text
    bad = requests.put(f"{pgw.url}/metrics/job/other/rank/1",
                       data="# TYPE training_step counter\ntraining_step 1\n", timeout=10)
    assert bad.status_code == 400, (bad.status_code, bad.text)
    scrape = requests.get(f"{pgw.url}/metrics", timeout=10)
    assert scrape.status_code == 200, scrape.text[:300]
    assert 'training_step{instance="",job="train",rank="0",run="r1"} 7' in scrape.text


def test_a_pushed_gpu_series_never_reaches_prometheus_nor_fires_a_gpu_alert(tmp_path, start_service):
    """Whoever holds the hook's credentials pushes an XID 79 "on" a GPU of their choosing, and a recorded
    series of the rules' own: Prometheus, scraping the real Pushgateway with the shipped job and rules,
    keeps neither (the job's keep-list), and GPUXidError never fires; the hook's own series get through."""
    pgw = start_service(processes.pushgateway(tmp_path))
    config = processes.render_prometheus_config(tmp_path, {"pushgateway": [f"127.0.0.1:{pgw.port}"]},
                                                scrape_interval="1s", evaluation_interval="1s")
    prometheus = start_service(processes.prometheus(tmp_path, config))
    forged = ('# TYPE nvml_gpu_xid_errors_total counter\n'
              'nvml_gpu_xid_errors_total{gpu="0",uuid="GPU-victim",xid="79",instance="victim-node:9942"} 3\n'
              '# TYPE job_run_rank:training_infra_cause:score gauge\n'
              'job_run_rank:training_infra_cause:score{run="r1",rank="0",cause="xid"} 0.95\n'
              '# TYPE training_step gauge\ntraining_step 7\n')
    pushed = requests.put(f"{pgw.url}/metrics/job/train/run/r1/rank/0", data=forged, timeout=10)
    assert pushed.status_code == 200, pushed.text
    wait_for_series(prometheus.url, 'training_step{job="train",run="r1"}', timeout=60)
    # Every rule group evaluated again 3 s after the scrape that brought the push in (GPUXidError has no `for`).
    wait_for_rule_evaluations(prometheus.url, time.time() + 3)
    assert query(prometheus.url, '{__name__=~"nvml_.*"}') == []
    assert query(prometheus.url, 'job_run_rank:training_infra_cause:score{cause="xid"}') == []
    assert query(prometheus.url, 'ALERTS{alertname="GPUXidError"}') == []

