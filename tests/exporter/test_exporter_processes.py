"""The processes collector against real processes: their names as any user sets them (not UTF-8),
their PID namespace and their PID in it (a process started under `unshare --pid`), on simulated GPUs
whose `processes` file lists those host PIDs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import pytest

from exporter.collectors.processes import identify, nspid
from exporter.simulated import CO_TENANT_PID, FAULT_AFTER, DeviceTraits, SimulatedNVML
from stack.processes import wait_until
from tests.support.exporter import Rig
from tests.support.namespaces import UNSHARE, own_namespace
from tests.support.nvml_faults import Fault
from tests.support.paths import REPO
from tests.support.process import children

#: A process name that is not UTF-8 (PR_SET_NAME takes any 15 bytes).
BAD_NAME = b"\xffco\x80tenant"
#: Sets its own name to argv[1] (hex) with prctl(PR_SET_NAME), says so, and waits for stdin to close.
NAMED = ("import ctypes, sys; ctypes.CDLL(None, use_errno=True).prctl(15, bytes.fromhex(sys.argv[1]), 0, 0, 0); "
         "print('named', flush=True); sys.stdin.read()")


def as_nobody(read: Callable[[], object]) -> object:
    """`read()` in a forked child running as nobody (uid and gid 65534, no capabilities)."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(writer, json.dumps(read()).encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as answer:
        text = answer.read()
    os.waitpid(child, 0)
    return [tuple(item) for item in json.loads(text)]


def listing(tmp_path: Path, *pids: int) -> str:
    """A simulator `processes` file: every pid on GPU 0, in this order."""
    path = tmp_path / "gpu-processes"
    path.write_text("".join(f"0 {pid}\n" for pid in pids))
    return str(path)


@pytest.fixture
def waiting():
    """Start `argv` with a pipe on stdin (closing it ends the process), wait for its first line;
    every process is ended after the test."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
        started.append(proc)
        assert proc.stdout.readline(), f"{argv} exited before it was ready"
        return proc

    yield start
    for proc in started:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_process_name_that_is_not_utf8_is_replaced_and_every_process_is_listed(tmp_path, waiting):
    """Any user can name a process with bytes that are not UTF-8: it is listed with the name's bad
    bytes replaced, and so is the process after it; the collector succeeds."""
    bad = waiting([sys.executable, "-c", NAMED, BAD_NAME.hex()])
    after = waiting([sys.executable, "-c", NAMED, b"after".hex()])
    assert Path(f"/proc/{bad.pid}/comm").read_bytes() == BAD_NAME + b"\n"
    rig = Rig(gpus=1, collectors=["processes"])
    rig.lib.processes = listing(tmp_path, bad.pid, after.pid)
    rig.step()
    names = {s["pid"]: s["process"] for s in rig.series("nvml_gpu_process_memory_used_bytes")}
    assert names == {str(bad.pid): BAD_NAME.decode(errors="replace"), str(after.pid): "after"}
    assert rig.value("nvml_exporter_collector_success", collector="processes") == 1
    assert rig.series("nvml_exporter_errors_total") == []


def test_text_from_proc_that_is_not_utf8_never_raises(tmp_path):
    """comm, status, cgroup and environ are all read as bytes and decoded with replacement."""
    base = tmp_path / "77"
    base.mkdir()
    (base / "comm").write_bytes(b"\xfe\xff\n")
    (base / "status").write_bytes(b"Name:\t\xfe\xff\nNSpid:\t77\t\xff\n")
    (base / "cgroup").write_bytes(b"0::/system.slice/slurmstepd.scope/job_31337/\xff/task_0\n")
    (base / "environ").write_bytes(b"SLURM_JOB_ID=\xff\0")
    identity = identify(77, tmp_path)
    assert identity.name == "\ufffd\ufffd" and identity.slurm_job_id == "31337"
    assert identity.pid_namespace == identity.namespace_pid == ""  # no ns/pid link: unknown


def test_a_process_in_its_own_pid_namespace_carries_that_namespace_and_its_pid_in_it(tmp_path, waiting):
    """NVML names host PIDs. A process in a container (here: `unshare --pid`) gets the inode of its
    PID namespace and its PID there (1: it is that namespace's init), as its hook reports them; a
    host process gets the host namespace and its own PID."""
    shell = waiting([*UNSHARE, sys.executable, "-c", "import sys; print('in', flush=True); sys.stdin.read()"])
    [inner] = wait_until(lambda: children(shell.pid), 10, what="the process unshare forked")
    host = waiting([sys.executable, "-c", NAMED, b"host".hex()])
    assert own_namespace(inner) != own_namespace()
    rig = Rig(gpus=1, collectors=["processes"])
    rig.lib.processes = listing(tmp_path, inner, host.pid)
    rig.step()
    found = {s["pid"]: (s["pid_namespace"], s["namespace_pid"])
             for s in rig.series("nvml_gpu_process_memory_used_bytes")}
    assert found == {str(inner): (own_namespace(inner), "1"), str(host.pid): (own_namespace(), str(host.pid))}


@pytest.mark.skipif(os.geteuid() != 0, reason="reads as another user: needs root to switch")
def test_without_ptrace_rights_a_process_is_known_by_its_innermost_pid_and_start_time(waiting):
    """An exporter running as another user, without CAP_SYS_PTRACE (Kubernetes: uid 10001, no
    capabilities), may not read a process's ns/pid link. It reads every process's innermost PID
    (NSpid) and start time all the same, the pair the hook reports; a process with a single NSpid
    field is in the exporter's own (host) namespace, one in a container of its own in one unknown."""
    shell = waiting([*UNSHARE, sys.executable, "-c", "import sys; print('in', flush=True); sys.stdin.read()"])
    [inner] = wait_until(lambda: children(shell.pid), 10, what="the process unshare forked")
    host = waiting([sys.executable, "-c", NAMED, b"host".hex()])
    started = {pid: Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19] for pid in (host.pid, inner)}
    read = as_nobody(lambda: [astuple(identify(pid, Path("/proc"), own_namespace()))[-3:] for pid in (host.pid, inner)])
    assert read == [(own_namespace(), str(host.pid), started[host.pid]), ("", "1", started[inner])]


#: In a PID namespace of its own: starts `sleep`, says so, waits for a line (the GPU listing,
#: argv[1], is written), then prints the processes series its exporter (a Rig) serves, as JSON.
CONTAINED_EXPORTER = """
import json, subprocess, sys
from tests.support.exporter import Rig
sleeper = subprocess.Popen(["sleep", "600"])
print(sleeper.pid, flush=True)
sys.stdin.readline()
rig = Rig(gpus=1, collectors=["processes"])
rig.lib.processes = sys.argv[1]
rig.step()
print(json.dumps(rig.series("nvml_gpu_process_memory_used_bytes")), flush=True)
sleeper.kill()
"""


def translated(gpu: int, pid: int) -> str:
    """A simulator `processes` line naming host process `pid` by its PID in each namespace we know
    it in: ours (the host's here) and its own."""
    inner = nspid(Path(f"/proc/{pid}/status").read_text())[-1]
    return f"{gpu} {own_namespace()}:{pid} {own_namespace(pid)}:{inner}\n"


def test_outside_the_host_pid_namespace_the_processes_nvml_lists_are_read_in_our_proc(tmp_path, waiting):
    """The driver translates its PIDs into the caller's PID namespace and leaves out what that
    namespace cannot see (the simulator too): an exporter in a PID namespace of its own lists only
    the processes of that namespace, by their PIDs there, named and attributed from its own /proc;
    a host process on the same GPU is not listed."""
    contained = waiting([*UNSHARE, sys.executable, "-c", CONTAINED_EXPORTER, str(tmp_path / "gpu-processes")])
    [exporter] = wait_until(lambda: children(contained.pid), 10, what="the process unshare forked")
    [sleeper] = wait_until(lambda: children(exporter), 10, what="its sleep")
    host = waiting([sys.executable, "-c", NAMED, b"host".hex()])
    (tmp_path / "gpu-processes").write_text(translated(0, sleeper) + translated(0, host.pid))
    contained.stdin.write(b"\n")
    contained.stdin.flush()
    served = json.loads(contained.stdout.readline())
    started = Path(f"/proc/{sleeper}/stat").read_text().rpartition(")")[2].split()[19]
    inner_sleeper = nspid(Path(f"/proc/{sleeper}/status").read_text())[-1]
    assert [(s["pid"], s["process"], s["pid_namespace"], s["namespace_pid"], s["start_time"]) for s in served] == \
        [(inner_sleeper, "sleep", own_namespace(sleeper), inner_sleeper, started)]


def test_the_simulator_lists_the_processes_its_file_names(tmp_path):
    """`processes`: "GPU PID" lines, read at every call (a demo names its runs once they started),
    each GPU's used memory shared by its processes; a GPU the file does not name, or a missing file,
    runs no process; lines that are not "GPU PID" are skipped."""
    lib = SimulatedNVML("healthy", 2, processes=tmp_path / "listing")
    lib.nvmlInit()
    gpu0, gpu1 = (lib.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    assert lib.nvmlDeviceGetComputeRunningProcesses(gpu0) == []
    (tmp_path / "listing").write_text("0 101\n0 102\n# a comment\n1 x\n2 103\n")
    listed = lib.nvmlDeviceGetComputeRunningProcesses(gpu0)
    assert [p.pid for p in listed] == [101, 102]
    assert listed[0].usedGpuMemory == listed[1].usedGpuMemory > 20 * 2**30
    assert lib.nvmlDeviceGetComputeRunningProcesses(gpu1) == []


def test_the_simulator_translates_pids_into_the_callers_namespace(tmp_path):
    """"GPU NAMESPACE:PID ..." lines: a caller in one of the named namespaces gets the PID there; a
    process named in none of the caller's is left out; a bare "GPU PID" line is that PID anywhere."""
    ours = own_namespace()
    (tmp_path / "listing").write_text(f"0 {ours}:101 4026532999:1\n0 4026532999:2\n"
                                      f"0 4026532998:7 {ours}:103\n0 104\n")
    lib = SimulatedNVML("healthy", 1, processes=tmp_path / "listing")
    lib.nvmlInit()
    listed = lib.nvmlDeviceGetComputeRunningProcesses(lib.nvmlDeviceGetHandleByIndex(0))
    assert [p.pid for p in listed] == [101, 103, 104]


SM = "nvml_gpu_process_sm_utilization_ratio"


def sm_by_pid(rig: Rig) -> dict[str, float]:
    return {s["pid"]: rig.value(SM, **s) for s in rig.series(SM)}


def test_each_process_sm_utilization_is_the_mean_of_its_samples_since_the_last_read():
    """The driver is asked for the samples newer than the newest it answered before; each listed
    process gets the mean of its own (the driver's empty entries, pid 0, are no process); the series
    carry the memory series' labels."""
    rig = Rig("co-tenant", 1, pid=1000, collectors=["processes"])
    asked, answers = [], []
    driver = rig.lib.nvmlDeviceGetProcessUtilization

    def spy(handle, timestamp):
        asked.append(timestamp)
        answers.append([])
        answers[-1] = driver(handle, timestamp)  # NOT_FOUND: answered nothing
        return answers[-1]

    rig.lib.nvmlDeviceGetProcessUtilization = spy
    rig.step()
    while rig.clock() - rig.lib.start < FAULT_AFTER + 10:
        rig.step()
    assert asked[0] == 0 and len(asked) > 2
    assert all(asked[i] == max([asked[i - 1], *(s.timeStamp for s in answers[i - 1])]) for i in range(1, len(asked)))
    newest = answers[-1]
    since = asked[-1]
    for pid in (1000, CO_TENANT_PID):
        mine = [s.smUtil / 100 for s in newest if s.pid == pid and s.timeStamp > since]
        assert mine and sm_by_pid(rig)[str(pid)] == pytest.approx(sum(mine) / len(mine))
    assert sm_by_pid(rig)[str(CO_TENANT_PID)] == pytest.approx(0.4)
    assert 0.45 < sm_by_pid(rig)["1000"] < 0.6
    memory = "nvml_gpu_process_memory_used_bytes"
    assert sorted(map(sorted, (s.items() for s in rig.series(SM)))) == \
        sorted(map(sorted, (s.items() for s in rig.series(memory))))
    assert rig.value("nvml_exporter_collector_success", collector="processes") == 1


def test_no_new_sample_not_found_means_every_process_computed_nothing():
    """NOT_FOUND: no sample newer than the timestamp (the driver takes none while processes idle):
    each listed process reads 0, and it is no error."""
    rig = Rig("healthy", 1, pid=1000, collectors=["processes"],
              faults=[Fault(function="nvmlDeviceGetProcessUtilization", error="NotFound", at=20)])
    rig.step(5)
    assert sm_by_pid(rig)["1000"] > 0.85
    rig.step(15)
    for _ in range(5):  # the collector's next run (every 5th sample)
        rig.step()
    assert sm_by_pid(rig) == {"1000": 0.0}
    assert rig.series("nvml_exporter_errors_total") == []
    assert rig.value("nvml_exporter_collector_success", collector="processes") == 1


@pytest.mark.parametrize("lacking", ["board", "binding"])
def test_a_board_or_binding_without_per_process_utilization_is_asked_once_and_exports_no_series(lacking):
    """NOT_SUPPORTED (some boards; MIG, the simulator's test shows), or an nvidia-ml-py without the
    function: no utilization series and no error, the processes' memory still exported, and the
    driver not asked again."""
    rig = Rig("healthy", 1, pid=1000, collectors=["processes"],
              devices={0: DeviceTraits(process_utilization=False)} if lacking == "board" else None,
              binding_lacks=("nvmlDeviceGetProcessUtilization",) if lacking == "binding" else ())
    for _ in range(12):
        rig.step()
    assert rig.series(SM) == [] and len(rig.series("nvml_gpu_process_memory_used_bytes")) == 1
    assert rig.lib.calls["nvmlDeviceGetProcessUtilization"] == (lacking == "board")
    assert rig.series("nvml_exporter_errors_total") == []
    assert rig.value("nvml_exporter_collector_success", collector="processes") == 1


def test_a_failed_utilization_read_is_counted_and_the_memory_series_stay():
    rig = Rig("healthy", 1, pid=1000, collectors=["processes"],
              faults=[Fault(function="nvmlDeviceGetProcessUtilization", error="Timeout")])
    rig.step()
    assert rig.series(SM) == [] and len(rig.series("nvml_gpu_process_memory_used_bytes")) == 1
    assert rig.value("nvml_exporter_errors_total", collector="processes", error="timeout") == 1
    assert rig.value("nvml_exporter_collector_success", collector="processes") == 0


def test_mps_clients_are_listed_with_the_mps_server_that_runs_their_work(tmp_path, waiting):
    """Under MPS the compute process list may hold the MPS server alone (comm nvidia-cuda-mps);
    nvmlDeviceGetMPSComputeRunningProcesses lists its clients: both are exported, each named, and
    the server is no co-tenant (rules/explain.yml, tests/stack/rules/co_tenant_test.yml)."""
    server = waiting([sys.executable, "-c", NAMED, b"nvidia-cuda-mps-server"[:15].hex()])
    client = waiting([sys.executable, "-c", NAMED, b"trainer".hex()])
    rig = Rig(gpus=1, collectors=["processes"], devices={0: DeviceTraits(mps_server=server.pid)})
    rig.lib.processes = listing(tmp_path, client.pid)
    rig.step()
    served = {s["pid"]: s["process"] for s in rig.series("nvml_gpu_process_memory_used_bytes")}
    assert served == {str(server.pid): "nvidia-cuda-mps", str(client.pid): "trainer"}
    assert rig.value("nvml_gpu_process_memory_used_bytes", **[s for s in rig.series(
        "nvml_gpu_process_memory_used_bytes") if s["pid"] == str(client.pid)][0]) > 2**30
    assert rig.series("nvml_exporter_errors_total") == []


def test_a_binding_without_the_mps_list_is_asked_once_and_lists_the_rest():
    rig = Rig("healthy", 1, pid=1000, collectors=["processes"],
              binding_lacks=("nvmlDeviceGetMPSComputeRunningProcesses",))
    for _ in range(12):
        rig.step()
    assert [s["pid"] for s in rig.series("nvml_gpu_process_memory_used_bytes")] == ["1000"]
    assert rig.lib.calls["nvmlDeviceGetMPSComputeRunningProcesses"] == 0
    assert rig.sampler.devices[0].lacks("nvmlDeviceGetMPSComputeRunningProcesses")
    assert rig.series("nvml_exporter_errors_total") == []
