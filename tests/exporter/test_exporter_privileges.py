"""--run-as: an exporter started as root opens the kernel log, then serves as an unprivileged user with
no capability left, and still reads the XIDs of the log it opened."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests

from exporter.cli import UsageError, parse_args
from exporter.privileges import leftovers, parse_run_as
from stack import processes
from stack.processes import wait_until
from tests.support.kernel_log import append, scrape_xids, xid_line
from tests.support.paths import REPO

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the exporter starts as root and drops it)")


def status(pid: int) -> dict[str, dict[str, str]]:
    """Each thread's /proc status lines (Uid, Gid, Groups, Cap*, NoNewPrivs), by thread id."""
    out = {}
    for path in Path(f"/proc/{pid}/task").glob("*/status"):
        lines = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
        out[path.parent.name] = {key: " ".join(lines[key].split()) for key in
                                 ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs")}
    return out


@needs_root
def test_an_exporter_started_as_root_serves_as_the_user_with_no_capability_and_reads_the_log_it_opened(
        tmp_path, start_service):
    kernel_log = tmp_path / "kmsg"  # readable by root alone, in a directory of root's alone: as /dev/kmsg
    kernel_log.write_text(xid_line(1, 62, kmsg=True))
    kernel_log.chmod(0o600)
    tmp_path.chmod(0o700)
    exporter = start_service(processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=2",
                                                           "--sample-interval=0.2", "--run-as=10001:10001",
                                                           f"--collector.xid.kernel-log={kernel_log}"]))
    threads = status(exporter.proc.pid)
    assert len(threads) > 2  # samplers, the XID watcher, the kernel log reader, the HTTP server
    for thread, fields in threads.items():
        assert fields == {"Uid": "10001 10001 10001 10001", "Gid": "10001 10001 10001 10001", "Groups": "",
                          "CapInh": "0" * 16, "CapPrm": "0" * 16, "CapEff": "0" * 16, "CapAmb": "0" * 16,
                          "NoNewPrivs": "1"}, thread
    append(kernel_log, xid_line(1, 79, kmsg=True))
    wait_until(lambda: scrape_xids(exporter) == {("1", "79"): 1.0}, timeout=20, what="XID 79 read after the drop")
    assert "serving as uid 10001, gid 10001, with no capability" in exporter.log_tail()
    exporter.stop()
    assert exporter.proc.returncode == 0, exporter.log_tail()


@needs_root
def test_an_exporter_that_cannot_drop_root_refuses_to_serve(tmp_path):
    """Without CAP_SETUID (compose's cap_drop ALL without SETUID), asking for --run-as stops the start."""
    service = processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=1", "--run-as=10001"])
    service.argv[:0] = ["setpriv", "--inh-caps=-all", "--bounding-set=-all,+syslog", "--"]
    with open(service.log_path, "w") as log:
        result = subprocess.run(service.argv, env=service.env, stdout=log, stderr=log, timeout=60)
    text = service.log_path.read_text()
    assert result.returncode == 1 and "error: cannot switch to uid 10001, gid 10001" in text, text
    assert "Traceback" not in text
    with pytest.raises(requests.ConnectionError):
        requests.get(service.url + "/metrics", timeout=2)


def test_run_as_takes_a_non_root_uid_and_gid_and_the_check_sees_root():
    assert parse_run_as("10001") == (10001, 10001) and parse_run_as("10001:65534") == (10001, 65534)
    assert parse_run_as("") is None and parse_args([], environ={}).run_as is None
    assert parse_args([], environ={"DUALTRACK_EXPORTER_RUN_AS": "10001:10001"}).run_as == (10001, 10001)
    for bad in ("0", "10001:0", "root", "-1", "1:2:3"):
        with pytest.raises(UsageError):
            parse_args([f"--run-as={bad}"], environ={})
    if os.geteuid() == 0:  # this test process: root, with capabilities
        assert leftovers(10001, 10001)


def copier(tmp_path: Path, source: Path, target: Path, *args: str) -> processes.Service:
    """The Kubernetes kernel-log reader (`python -m exporter.kernellog_copy`), not yet started."""
    argv = [sys.executable, "-m", "exporter.kernellog_copy", f"--from={source}", f"--to={target}", *args]
    return processes.Service("kernellog-copy", argv, 0, tmp_path / "copy.log", ready_path=None,
                             env={**os.environ, "PYTHONPATH": str(REPO)})


@needs_root
def test_the_kubernetes_reader_copies_only_the_kernels_xid_records_as_an_unprivileged_user(tmp_path, start_service,
                                                                                            request):
    """components/kernel-log: a privileged reader (here: root) opens the log, drops to 10001 and copies the
    kernel's XID records to a shared volume; the unprivileged exporter follows that file."""
    private = tmp_path / "host"
    private.mkdir(mode=0o700)
    shared = Path(tempfile.mkdtemp(prefix="dualtrack-emptydir-"))  # tmp_path's parents are root's alone
    shared.chmod(0o777)  # as an emptyDir
    request.addfinalizer(lambda: shutil.rmtree(shared))
    kernel_log, copied = private / "kmsg", shared / "xid.log"
    kernel_log.write_text(xid_line(0, 48, kmsg=True))  # before the reader started: never copied
    kernel_log.chmod(0o600)
    reader = start_service(copier(tmp_path, kernel_log, copied, "--run-as=10001:10001",
                                  f"--max-bytes={3 * len(xid_line(1, 79, kmsg=True))}"))
    wait_until(copied.exists, timeout=20, what="the copy created")
    exporter = start_service(processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=2",
                                                           "--sample-interval=0.2", "--run-as=10001:10001",
                                                           f"--collector.xid.kernel-log={copied}"]))
    for fields in status(reader.proc.pid).values():
        assert fields["Uid"] == "10001 10001 10001 10001" and fields["CapEff"] == fields["CapPrm"] == "0" * 16
    append(kernel_log, "6,9,9,-;tmpfs: Unknown parameter 'NVRM: Xid (PCI:0000:2a:00): 79'\n",
           "12,10,10,-;NVRM: Xid (PCI:0000:2a:00): 79, from userspace\n", "6,11,11,-;eth0: link up\n",
           *(xid_line(1, 79, kmsg=True) for _ in range(4)))  # past --max-bytes: a new file after the third
    wait_until(lambda: scrape_xids(exporter) == {("1", "79"): 4.0}, timeout=20, what="four XID 79 through the copy")
    assert copied.read_text() == xid_line(1, 79, kmsg=True)  # the fourth, in the new file; nothing else
    reader.stop()
    assert reader.proc.returncode == 0, reader.log_tail()
