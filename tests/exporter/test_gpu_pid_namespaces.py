"""What only hardware settles about PIDs and privilege (runs only where a GPU is present, as root).

- NVML translates the PIDs of its process lists into the caller's PID namespace and leaves out the
  processes that namespace cannot see (open-gpu-kernel-modules: os_find_ns_pid), as the simulator
  does: checked from the host namespace (`--pid=host`) and from a PID namespace of its own (a
  container without it), each with a CUDA process of its own and one of the other's.
- The exporter with Kubernetes' rights (uid 10001, no capability) names a CUDA process in a container
  of its own by the innermost PID and start time the hook reports.
- A GPU in MIG mode: the parent's memory answers NO_PERMISSION without CAP_SYS_ADMIN (nvml.h), and the
  exporter serves it as the sum of its GPU instances, with no error.

CUDA contexts come from libcuda through ctypes (the suite's torch may be a CPU build).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from stack import processes
from stack.processes import wait_until
from tests.support.paths import REPO
from tests.support.process import children

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                                 reason="needs root, unshare and setpriv")]

#: Holds a CUDA context on GPU 0, prints what the hook reports of itself and the PIDs NVML lists on GPU 0
#: (after the context exists) as JSON, then waits for stdin to close.
CUDA_PROCESS = """
import ctypes, json, os, sys
sys.path.insert(0, sys.argv[1])
import pynvml
from trainer_hook.identity import own_pid_namespace, own_start_time
cuda = ctypes.CDLL("libcuda.so.1")
device, context = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device) == 0
pynvml.nvmlInit()
listed = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))]
print(json.dumps({"pid": os.getpid(), "pid_namespace": own_pid_namespace(), "start_time": own_start_time(),
                  "listed": listed}), flush=True)
sys.stdin.read()
"""
#: The PIDs NVML lists on GPU 0, as JSON.
LIST = """
import json, pynvml
pynvml.nvmlInit()
print(json.dumps([p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))]))
"""
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
KUBERNETES = ["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
              "--"]


@pytest.fixture
def cuda_process():
    """Start CUDA_PROCESS (under `prefix`, e.g. unshare); yields (its host PID, what it printed)."""
    started: list[subprocess.Popen] = []

    def start(prefix: list[str]) -> tuple[int, dict]:
        proc = subprocess.Popen([*prefix, sys.executable, "-c", CUDA_PROCESS, str(REPO)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
        started.append(proc)
        line = proc.stdout.readline()
        assert line, "the CUDA process exited before it reported"
        kids = children(proc.pid) if prefix else set()
        host_pid = kids.pop() if kids else proc.pid
        return host_pid, json.loads(line)

    yield start
    for proc in started:
        proc.stdin.close()
        proc.wait(30)


def listed_from(prefix: list[str]) -> list[int]:
    out = subprocess.run([*prefix, sys.executable, "-c", LIST], capture_output=True, text=True, check=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    return json.loads(out)


def test_nvml_lists_pids_in_the_callers_namespace_and_leaves_out_what_it_cannot_see(cuda_process):
    host_pid, host_report = cuda_process([])
    contained_pid, contained_report = cuda_process(UNSHARE)
    assert contained_report["pid"] == 1 and contained_pid != 1
    # the host namespace (an exporter with --pid=host) sees both, by their host PIDs
    assert {host_pid, contained_pid} <= set(listed_from([]))
    # a PID namespace of its own (an exporter without it) sees its own process, by its PID there, only
    assert contained_report["listed"] == [1]
    assert host_pid not in listed_from(UNSHARE)


def test_the_kubernetes_exporter_names_a_contained_cuda_process_by_innermost_pid_and_start_time(tmp_path,
                                                                                              cuda_process,
                                                                                              start_service):
    host_pid, report = cuda_process(UNSHARE)
    service = processes.exporter(tmp_path, ["--sample-interval=0.5"])
    service.argv[:0] = KUBERNETES
    exporter = start_service(service)

    def served() -> dict | None:
        text = requests.get(exporter.url + "/metrics", timeout=10).text
        found = [s.labels for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name == "nvml_gpu_process_memory_used_bytes" and s.labels["pid"] == str(host_pid)]
        return found[0] if found else None
    labels = wait_until(served, 30, what="the contained CUDA process served")
    assert (labels["namespace_pid"], labels["start_time"]) == ("1", report["start_time"])
    assert labels["pid_namespace"] == ""  # uid 10001 may not read a root process's ns/pid link


def mig_gpus() -> list[int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,mig.mode.current", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return [int(row.split(",")[0]) for row in out.splitlines() if row.split(",")[1].strip() == "Enabled"]


PARENT_MEMORY = """
import sys, pynvml
pynvml.nvmlInit()
try:
    pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(int(sys.argv[1])))
    print("answered")
except pynvml.NVMLError_NoPermission:
    print("no_permission")
"""


def test_a_mig_gpus_parent_memory_needs_privilege_and_the_exporter_sums_its_instances(tmp_path, start_service):
    gpus = mig_gpus()
    if not gpus:
        pytest.skip("no GPU in MIG mode here")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for gpu in gpus:
        root = subprocess.run([sys.executable, "-c", PARENT_MEMORY, str(gpu)], capture_output=True, text=True,
                              env=env, check=True, timeout=60).stdout.strip()
        unprivileged = subprocess.run([*KUBERNETES, sys.executable, "-c", PARENT_MEMORY, str(gpu)],
                                      capture_output=True, text=True, env=env, check=True, timeout=60).stdout.strip()
        assert (root, unprivileged) == ("answered", "no_permission"), gpu
    service = processes.exporter(tmp_path, ["--sample-interval=0.5"])
    service.argv[:0] = KUBERNETES
    exporter = start_service(service)

    def scrape() -> dict | None:
        text = requests.get(exporter.url + "/metrics", timeout=10).text
        samples: dict[str, list] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((s.labels, s.value))
        return samples if samples.get("nvml_gpu_mig_memory_total_bytes") else None
    samples = wait_until(scrape, 30, what="the GPU instances' memory served")
    for gpu in gpus:
        instances = [v for labels, v in samples["nvml_gpu_mig_memory_total_bytes"] if labels["gpu"] == str(gpu)]
        [total] = [v for labels, v in samples["nvml_gpu_memory_total_bytes"] if labels["gpu"] == str(gpu)]
        assert total == sum(instances)
    errors = samples.get("nvml_exporter_errors_total", [])
    assert not [labels for labels, _ in errors if labels["collector"] in ("memory", "processes")]
