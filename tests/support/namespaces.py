"""Processes in PID namespaces of their own, as in a container or pod, and a stack whose simulated GPU
runs the processes a listing names (their host PIDs, as NVML reports them)."""
from __future__ import annotations

import os

from stack import processes
from stack.processes import Service
from tests.support import daemons

#: Runs in a PID namespace of its own (with its own /proc), until stdin closes.
UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child"]


def own_namespace(pid: int | str = "self") -> str:
    return str(os.stat(f"/proc/{pid}/ns/pid").st_ino)


#: A training loop with the hook, until killed: argv = Pushgateway URL, run, GPU uuid.
TRAIN = """
import sys, time, torch
from trainer_hook import TrainingMonitor
monitor = TrainingMonitor(job="pidns", run=sys.argv[2], pushgateway=sys.argv[1], push_interval=0.2,
                          gpu_uuid=sys.argv[3], record_path=False)
while True:
    monitor.log({"loss": torch.tensor(1.0)})
    time.sleep(0.05)
"""


def live_stack(tmp_path, start_service, listing, rights: tuple[str, ...] = ()) -> tuple[Service, Service, str]:
    """A Pushgateway; an exporter (run by `setpriv *rights` when given) whose one simulated GPU runs the
    processes `listing` names; a Prometheus with the repo's rules scraping both every second. Returns
    (pushgateway, prometheus, the GPU's uuid) once Prometheus has the GPU."""
    pgw = start_service(processes.pushgateway(tmp_path))
    service = processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=1", "--sample-interval=0.2",
                                            f"--simulate.processes={listing}"])
    if rights:
        service.argv[:0] = ["setpriv", *rights, "--"]
    exporter = start_service(service)
    config = processes.render_prometheus_config(
        tmp_path, {processes.EXPORTER_JOB: [exporter.address], processes.PUSHGATEWAY_JOB: [pgw.address]},
        scrape_interval="1s", evaluation_interval="1s")
    prom = start_service(processes.prometheus(tmp_path, config))
    [gpu] = daemons.wait_for_series(prom.url, "nvml_gpu_info", 30)
    return pgw, prom, gpu["metric"]["uuid"]
