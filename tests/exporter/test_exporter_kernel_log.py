"""XIDs from the kernel log (--collector.xid.kernel-log): matched by PCI bus id, counted once with the
NVML events, never again after a restart, and an unreadable log costs one warning, never a scrape."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from exporter import kernellog
from exporter.cli import kernel_log_path, parse_args
from exporter.collectors.xid import MATCH_WINDOW, XidCounts
from exporter.kernellog import bus_key, parse_xid
from stack import processes
from stack.processes import wait_until
from tests.support.exporter import FakeClock, Rig
from tests.support.kernel_log import append, scrape_xids, xid_line
from tests.support.nvml_faults import Fault
from tests.support.process import readable_copy, runnable_as


def xid_count(rig: Rig, gpu: int, code: int) -> float | None:
    rig.step(0.01)
    return rig.value("nvml_gpu_xid_errors_total", gpu=str(gpu), uuid=rig.sampler.devices[gpu].uuid, xid=str(code),
                     gpu_instance="")


def started(rig: Rig) -> Rig:
    rig.sampler.xid.start()
    rig.sampler.kernel_log.start()
    wait_until(rig.sampler.kernel_log.settled.is_set, timeout=5, what="the kernel log opened")
    return rig


def test_nvml_and_kernel_bus_id_forms_name_the_same_gpu():
    assert bus_key("00000000:3B:00.0") == bus_key("0000:3b:00") == bus_key("3b:00") == (0, 0x3B, 0)
    assert bus_key("00000001:3B:00.0") != bus_key("0000:3b:00")
    assert parse_xid(xid_line(1, 79, kmsg=True).encode()) == ((0, 0x2A, 0), 79, "")
    assert parse_xid(b"<4>[ 269.517039] NVRM: Xid (0000:01:00): 3, C 00000005") == ((0, 1, 0), 3, "")  # older drivers
    assert parse_xid(b"6,1,2,-;NVRM: GPU at PCI:0000:2a:00: GPU-0b11d014") is None
    assert bus_key("not a bus id") is None


def test_kernel_log_xids_count_on_the_gpu_of_their_bus_id_from_the_exporters_start_on(tmp_path):
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text(xid_line(1, 79))  # logged before the exporter started: already counted or seen
    rig = started(Rig(gpus=2, collectors=["xid"], xid_kernel_log=str(kernel_log)))
    try:
        append(kernel_log, xid_line(1, 119, kmsg=True), "4,7,8,-;NVRM: Xid (PCI:0000:99:00): 13, a GPU not exported\n",
               xid_line(1, 119))
        wait_until(lambda: xid_count(rig, 1, 119) == 2, timeout=10, what="two XID 119 on GPU 1")
        assert xid_count(rig, 1, 79) is None and rig.series("nvml_gpu_xid_errors_total") == [
            {"gpu": "1", "uuid": rig.sampler.devices[1].uuid, "xid": "119", "gpu_instance": ""}]
        with open(kernel_log, "a") as handle:  # a line written in two pieces is one line
            handle.write(xid_line(0, 120)[:20])
            handle.flush()
            rig.step(0.01)
            handle.write(xid_line(0, 120)[20:])
        wait_until(lambda: xid_count(rig, 0, 120) == 1, timeout=10, what="XID 120 on GPU 0")
    finally:
        assert rig.sampler.stop()
    assert not rig.sampler.kernel_log._thread.is_alive()


def test_an_xid_that_nvml_and_the_kernel_log_both_report_counts_once(tmp_path):
    kernel_log = tmp_path / "kmsg"
    kernel_log.touch()
    # NVML first: XID 48 on GPU 0 at t = 0; the kernel log second
    rig = started(Rig(gpus=2, faults=[Fault(gpu=0, xid=48, times=1), Fault(gpu=0, xid=63, at=5, times=1),
                                       Fault(gpu=0, xid=31, at=5, times=1)],
                      collectors=["xid"], xid_kernel_log=str(kernel_log)))
    try:
        wait_until(lambda: xid_count(rig, 0, 48) == 1, timeout=10, what="XID 48 from NVML")
        append(kernel_log, xid_line(0, 48), xid_line(0, 43))  # 43: read after 48, so 48 was read
        wait_until(lambda: xid_count(rig, 0, 43) == 1, timeout=10, what="the kernel log read")
        assert xid_count(rig, 0, 48) == 1
        # the kernel log first: XID 63, then NVML's event for it (and 31 after it) at t = 5
        append(kernel_log, xid_line(0, 63))
        wait_until(lambda: xid_count(rig, 0, 63) == 1, timeout=10, what="XID 63 from the kernel log")
        rig.step(5.0)
        wait_until(lambda: xid_count(rig, 0, 31) == 1, timeout=10, what="NVML's events")
        assert xid_count(rig, 0, 63) == 1
    finally:
        rig.sampler.stop()


def test_the_same_xid_twice_counts_twice_and_a_late_match_is_a_new_xid():
    clock = FakeClock()
    counts = XidCounts(clock=clock)
    assert [counts.add(0, 79, source) for source in ("nvml", "nvml", "kernel", "kernel", "kernel")] == \
        [True, True, False, False, True]  # a storm seen by both sources counts each XID once
    clock.advance(MATCH_WINDOW + 1)
    assert counts.add(0, 79, "nvml") is True  # too late to be the kernel's third: another XID
    assert counts.add(1, 79, "kernel") is True  # another GPU
    assert counts.counts(0) == {("79", ""): 4} and counts.counts(1) == {("79", ""): 1}


def test_a_kernel_log_that_cannot_be_read_is_one_warning_and_one_error_and_nvml_xids_still_count(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="exporter.kernellog")
    for path, error in ((tmp_path / "missing", "kernel_log_enoent"), (tmp_path, "kernel_log_eisdir")):
        caplog.clear()
        rig = started(Rig(gpus=1, faults=[Fault(gpu=0, xid=79, times=1)], collectors=["xid"],
                          xid_kernel_log=str(path)))
        try:
            rig.step()
            assert rig.sampler.ready()  # an unreadable log does not hold readiness back
            wait_until(lambda rig=rig: xid_count(rig, 0, 79) == 1, timeout=10, what="NVML's XID")
            assert rig.value("nvml_exporter_errors_total", collector="xid", error=error) == 1
        finally:
            assert rig.sampler.stop()
        warnings = [r.getMessage() for r in caplog.records if r.name == "exporter.kernellog"]
        assert len(warnings) == 1 and str(path) in warnings[0] and "CAP_SYSLOG" in warnings[0], warnings


def test_a_truncated_kernel_log_file_is_read_again_from_its_start(tmp_path):
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text(xid_line(0, 13) * 50)
    rig = started(Rig(gpus=1, collectors=["xid"], xid_kernel_log=str(kernel_log)))
    try:
        kernel_log.write_text(xid_line(0, 45))  # truncated and rewritten: shorter than where the reader is
        wait_until(lambda: xid_count(rig, 0, 45) == 1, timeout=10, what="the rewritten file read")
        assert xid_count(rig, 0, 13) is None
    finally:
        rig.sampler.stop()


def test_the_exporter_counts_kernel_log_xids_and_never_again_after_a_restart(tmp_path, start_service):
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text(xid_line(1, 62))  # before the exporter's first start
    exporter = start_service(processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=2",
                                                           "--sample-interval=0.2",
                                                           f"--collector.xid.kernel-log={kernel_log}"]))
    append(kernel_log, xid_line(1, 79, kmsg=True))
    wait_until(lambda: scrape_xids(exporter) == {("1", "79"): 1.0}, timeout=20, what="XID 79 on GPU 1 served")
    exporter.restart()
    assert scrape_xids(exporter) == {}  # ready: the log was opened at its end, and nothing is counted again
    append(kernel_log, xid_line(0, 119))
    wait_until(lambda: scrape_xids(exporter) == {("0", "119"): 1.0}, timeout=20, what="XID 119 on GPU 0 served")
    exporter.stop()
    assert exporter.proc.returncode == 0, exporter.log_tail()


def test_the_real_dev_kmsg_is_followed_from_its_end(tmp_path):
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg is not readable here")
    rig = started(Rig(gpus=1, collectors=["xid"], xid_kernel_log="/dev/kmsg"))
    try:
        rig.step(0.5)  # the records since boot are not replayed: no XID, no error, reading goes on
        assert rig.series("nvml_gpu_xid_errors_total") == [] and rig.series("nvml_exporter_errors_total") == []
        assert rig.sampler.kernel_log._fd is not None
    finally:
        assert rig.sampler.stop()


def errors_served(service: processes.Service) -> dict[str, float]:
    text = requests.get(service.url + "/metrics", timeout=5).text
    return {s.labels["error"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "nvml_exporter_errors_total" and s.labels["collector"] == "xid"}


@pytest.mark.skipif(os.geteuid() != 0 or Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() != "1"
                    or not shutil.which("setpriv"), reason="needs root, setpriv and kernel.dmesg_restrict=1")
def test_the_deployments_rights_are_what_reading_dev_kmsg_takes(tmp_path, start_service):
    """The real /dev/kmsg under kernel.dmesg_restrict=1, with the rights each deployment grants."""
    unprivileged = ["--reuid=10001", "--regid=10001", "--clear-groups"]
    grants = {  # the Dockerfile's user with no capability (and its DUALTRACK_EXPORTER_RUN_AS, then a check
              # alone): refused, one warning, the scrape unaffected
              "none": [*unprivileged, "--inh-caps=-all", "--bounding-set=-all"],
              # systemd: DynamicUser with AmbientCapabilities=CAP_SYSLOG
              "systemd": [*unprivileged, "--inh-caps=+syslog", "--ambient-caps=+syslog", "--bounding-set=-all,+syslog"],
              # compose: uid 0 with CAP_SYSLOG, CAP_SETUID and CAP_SETGID (cap_drop ALL), serving as 10001
              "compose": ["--inh-caps=-all", "--bounding-set=-all,+syslog,+setuid,+setgid"]}
    if reason := runnable_as(10001, "pynvml"):  # the exporter's one dependency
        pytest.skip(reason)
    with readable_copy("exporter") as code:  # uid 10001 may not enter the checkout (a clone in /root)
        for name, rights in grants.items():
            service = processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=1",
                                                    "--collector.xid.kernel-log=/dev/kmsg",
                                                    *(["--run-as=10001:10001"] if name != "systemd" else [])],
                                         env={"PYTHONPATH": str(code)})
            service.argv[:0] = ["setpriv", *rights, "--"]
            exporter = start_service(service)
            assert errors_served(exporter) == ({"kernel_log_eperm": 1.0} if name == "none" else {}), name
            if name == "none":  # EPERM without CAP_SYSLOG: the syslog check, not the device cgroup
                assert "CAP_SYSLOG" in exporter.log_tail() and "device cgroup does not" not in exporter.log_tail()
            if name == "compose":
                assert "Uid:\t10001\t" in Path(f"/proc/{exporter.proc.pid}/status").read_text()
            exporter.stop()
            assert exporter.proc.returncode == 0, exporter.log_tail()


DEVICES_CGROUP = Path("/sys/fs/cgroup/devices")


@pytest.mark.skipif(os.geteuid() != 0 or not (DEVICES_CGROUP / "devices.deny").exists(),
                    reason="needs root and the cgroup v1 devices controller")
def test_a_device_cgroup_refusing_dev_kmsg_is_named_even_with_every_capability(tmp_path, start_service):
    """What a non-privileged Kubernetes container meets: /dev/kmsg (c 1:11) off the device allowlist. Root
    with CAP_SYSLOG gets EPERM; the warning names the device cgroup, not CAP_SYSLOG."""
    cgroup = DEVICES_CGROUP / f"dualtrack-test-{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "devices.deny").write_text("c 1:11 rwm\n")
        service = processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=1",
                                                "--collector.xid.kernel-log=/dev/kmsg"])
        service.argv[:0] = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"]
        exporter = start_service(service)
        assert errors_served(exporter) == {"kernel_log_eperm": 1.0}
        warning = exporter.log_tail()
        assert "EPERM: the device cgroup does not allow /dev/kmsg" in warning and "CAP_SYSLOG to" not in warning
        exporter.stop()
    finally:
        cgroup.rmdir()


def test_the_flag_defaults_to_dev_kmsg_and_an_empty_value_turns_it_off():
    assert kernel_log_path(parse_args([], environ={})) == "/dev/kmsg"
    assert kernel_log_path(parse_args(["--simulate=healthy"], environ={})) == ""  # made-up bus ids
    assert kernel_log_path(parse_args(["--simulate=healthy", "--collector.xid.kernel-log=/x"], environ={})) == "/x"
    assert kernel_log_path(parse_args([], environ={"DUALTRACK_EXPORTER_COLLECTOR_XID_KERNEL_LOG": ""})) == ""
    assert kernel_log_path(parse_args(["--collector.xid.kernel-log="], environ={})) == ""


def served_xids(rig: Rig) -> dict[tuple[str, str, str], float]:
    """Every nvml_gpu_xid_errors_total series served: {(gpu, xid, gpu_instance): count}."""
    rig.step(0.01)
    return {(s.labels["gpu"], s.labels["xid"], s.labels["gpu_instance"]): s.value
            for family in text_string_to_metric_families(rig.exposition()) for s in family.samples
            if s.name == "nvml_gpu_xid_errors_total"}


def test_only_the_kernels_own_xid_records_count_not_quoted_or_userspace_ones(tmp_path):
    kernel_log = tmp_path / "kmsg"
    kernel_log.touch()
    rig = started(Rig(gpus=2, collectors=["xid"], xid_kernel_log=str(kernel_log)))
    forged = "NVRM: Xid (PCI:0000:2a:00): 79"
    try:
        append(kernel_log,
               # what any user with a user namespace makes the kernel log: mount -t tmpfs -o "NVRM: Xid ..." ...
               f"3,2201,7000001,-;tmpfs: Unknown parameter '{forged}'\n",
               f"<3>[    7.000001] tmpfs: Unknown parameter '{forged}'\n",
               # what any process allowed to write /dev/kmsg logs: the kernel forces facility 1 (user) on it
               f"12,2202,7000002,-;{forged}, pid=1, name=python3\n", f"<14>[    7.000002] {forged}, pid=1\n",
               f"{forged}, a line with no priority\n", f"[    7.000003] {forged}, a dmesg line with no priority\n",
               f"4,2203,7000003,-; {forged}, not at the message's start\n",
               xid_line(1, 119, kmsg=True))  # the kernel's own record, read after every forged one
        wait_until(lambda: served_xids(rig) == {("1", "119", ""): 1.0}, timeout=10, what="XID 119 alone")
    finally:
        assert rig.sampler.stop()


def test_a_mig_xid_counts_on_its_gpu_instance(tmp_path):
    kernel_log = tmp_path / "kmsg"
    kernel_log.touch()
    rig = started(Rig(gpus=2, collectors=["xid"], xid_kernel_log=str(kernel_log)))
    try:
        append(kernel_log, "3,3001,8000000,-;NVRM: Xid (PCI:0000:2a:00 GPU-I:01 GPU-CI:00): 13, pid=4242, "
                           "name=python3, Graphics Exception: ESR 0x405840=0x4\n",
               "<3>[    8.100000] NVRM: Xid (PCI:0000:2a:00 GPU-I:02 GPU-CI:01): 31, pid=4243, name=python3\n",
               xid_line(0, 48, kmsg=True))
        wait_until(lambda: served_xids(rig) == {("1", "13", "1"): 1.0, ("1", "31", "2"): 1.0, ("0", "48", ""): 1.0},
                   timeout=10, what="the MIG XIDs on their GPU instances")
    finally:
        assert rig.sampler.stop()


def test_a_hundred_thousand_distinct_codes_make_one_other_series_and_one_log_line(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="exporter.collectors.xid")
    kernel_log = tmp_path / "kmsg"
    kernel_log.touch()
    rig = started(Rig(gpus=2, collectors=["xid"], xid_kernel_log=str(kernel_log)))
    try:
        codes = range(1000, 101_000)
        append(kernel_log, *(f"3,{n},9000000,-;NVRM: Xid (PCI:0000:2a:00): {n}, pid=1, name=x\n" for n in codes),
               xid_line(1, 79, kmsg=True))
        wait_until(lambda: served_xids(rig).get(("1", "79", "")) == 1.0, timeout=30, what="the last record read")
        assert served_xids(rig) == {("1", "other", ""): len(codes), ("1", "79", ""): 1.0}
        counts = rig.sampler.xid_counts
        assert len(counts._unmatched) <= 2 and len(counts._logged) <= 2  # bounded by the catalogue, not the codes
    finally:
        assert rig.sampler.stop()
    assert len([r for r in caplog.records if "XID" in r.getMessage()]) == 2  # "other" once, 79 once


def test_a_read_error_goes_on_from_the_end_and_never_counts_the_log_again(tmp_path, monkeypatch):
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text(xid_line(0, 13, kmsg=True) * 50)  # the ring buffer before the exporter started
    rig = started(Rig(gpus=1, collectors=["xid"], xid_kernel_log=str(kernel_log)))
    reader, real_read = rig.sampler.kernel_log, os.read
    failing, failed, read_again = threading.Event(), threading.Event(), threading.Event()

    def read(fd: int, size: int) -> bytes:
        if fd == reader._fd and failing.is_set() and not failed.is_set():
            failed.set()
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if failed.is_set() and threading.current_thread() is reader._thread:
            read_again.set()
        return real_read(fd, size)

    monkeypatch.setattr(os, "read", read)
    try:
        append(kernel_log, xid_line(0, 79, kmsg=True))
        wait_until(lambda: xid_count(rig, 0, 79) == 1, timeout=10, what="XID 79")
        failing.set()
        wait_until(read_again.is_set, timeout=10, what="a read after the EIO")
        append(kernel_log, xid_line(0, 120, kmsg=True))
        wait_until(lambda: xid_count(rig, 0, 120) == 1, timeout=10, what="XID 120 after the EIO")
        assert served_xids(rig) == {("0", "79", ""): 1.0, ("0", "120", ""): 1.0}  # 13 and 79 not counted again
    finally:
        monkeypatch.undo()
        assert rig.sampler.stop()


@pytest.mark.parametrize("error, hint", [(errno.EPERM, "EPERM: the device cgroup"), (errno.EACCES, "CAP_SYSLOG")])
def test_the_warning_names_what_refused_the_kernel_log(tmp_path, monkeypatch, caplog, error, hint):
    """The kernel answers EPERM for a device cgroup that does not allow /dev/kmsg even to a process
    holding CAP_SYSLOG (this one, root, holds it); without CAP_SYSLOG, EPERM is the syslog check."""
    caplog.set_level(logging.WARNING, logger="exporter.kernellog")
    kernel_log, real_open = tmp_path / "kmsg", os.open
    kernel_log.touch()

    def refusing_open(path, *args, **kwargs):
        if str(path) == str(kernel_log):
            raise OSError(error, os.strerror(error))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    rig = started(Rig(gpus=1, collectors=["xid"], xid_kernel_log=str(kernel_log)))
    try:
        assert rig.sampler.stop()
    finally:
        monkeypatch.undo()
    warning, = [r.getMessage() for r in caplog.records if r.name == "exporter.kernellog"]
    assert hint in warning and ("device cgroup" in warning) == (error == errno.EPERM), warning
    assert rig.value("nvml_exporter_errors_total", collector="xid",
                     error=f"kernel_log_{errno.errorcode[error].lower()}") == 1
    no_syslog = tmp_path / "status"
    no_syslog.write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    restricted = tmp_path / "dmesg_restrict"
    restricted.write_text("1\n")
    assert "CAP_SYSLOG" in kernellog.open_failure_hint(errno.EPERM, str(no_syslog), str(restricted))
    assert "device cgroup does not" not in kernellog.open_failure_hint(errno.EPERM, str(no_syslog), str(restricted))


def test_a_mig_xid_nvml_delivers_first_keeps_its_gpu_instance_and_counts_once(tmp_path):
    """NVML's event names the GPU instance too (gpuInstanceId; 0xFFFFFFFF for a whole GPU)."""
    kernel_log = tmp_path / "kmsg"
    kernel_log.touch()
    rig = started(Rig(gpus=1, faults=[Fault(gpu=0, xid=13, gpu_instance=2, times=1)], collectors=["xid"],
                      xid_kernel_log=str(kernel_log)))
    try:
        wait_until(lambda: served_xids(rig) == {("0", "13", "2"): 1.0}, timeout=10, what="NVML's MIG XID")
        append(kernel_log, "3,4001,9000000,-;NVRM: Xid (PCI:0000:18:00 GPU-I:02 GPU-CI:00): 13, pid=1, name=x\n",
               xid_line(0, 43, kmsg=True))
        wait_until(lambda: xid_count(rig, 0, 43) == 1, timeout=10, what="the kernel log read")
        assert served_xids(rig) == {("0", "13", "2"): 1.0, ("0", "43", ""): 1.0}
    finally:
        assert rig.sampler.stop()
