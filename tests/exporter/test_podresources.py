"""Pod attribution: the pod-resources collector against a fake kubelet speaking gRPC on a unix socket."""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import requests

from exporter.collectors import podresources
from exporter.simulated import DeviceTraits, simulated_uuid
from stack import processes
from tests.support.exporter import Rig
from tests.support.kubelet import listing

# A ListPodResourcesResponse serialized by code generated from the kubelet's own v1 api.proto (protoc
# 7.36): pod trainer-0/ml, container pytorch holds GPU-1111... and MIG-aaaa... plus a NIC, exclusive
# CPUs, memory with NUMA topology and a DRA claim (fields the collector does not read); a sidecar
# without devices; pod notebook/research holds a time-sliced replica GPU-1111...::1.
KUBELET_RESPONSE = bytes.fromhex(
    "0aa5020a09747261696e65722d3012026d6c1a84020a077079746f726368123e0a0e6e76696469612e636f6d2f67707512284750"
    "552d31313131313131312d323232322d333333332d343434342d3535353535353535353535351a020a0012420a166e76696469612e"
    "636f6d2f6d69672d31672e3130676212284d49472d61616161616161612d626262622d636363632d646464642d65656565656565656565"
    "656512170a0f6578616d706c652e636f6d2f6e69631204657468371a02020322120a066d656d6f72791080808080041a020a002a4412"
    "096770752d636c61696d1a026d6c22330a120a106e76696469612e636f6d2f6770753d31120e6770752e6e76696469612e636f6d1a06"
    "6e6f64652d3122056770752d311a090a0773696465636172220202030a650a086e6f7465626f6f6b120872657365617263681a4f0a07"
    "6a75707974657212440a156e76696469612e636f6d2f6770752e736861726564122b4750552d31313131313131312d323232322d3333"
    "33332d343434342d3535353535353535353535353a3a31")
WHOLE_GPU = "GPU-11111111-2222-3333-4444-555555555555"


class FakeKubelet:
    """v1.PodResourcesLister on a unix socket; List answers `response` (serialized bytes) and keeps the
    requests it got (serialized)."""

    def __init__(self, socket_path: Path, response: bytes = b"", delay: float = 0.0) -> None:
        self.socket_path = socket_path
        self.response = response
        self.delay = delay
        self.requests: list[bytes] = []
        handler = grpc.unary_unary_rpc_method_handler(self._list)  # bytes in, bytes out
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("v1.PodResourcesLister",
                                                                                   {"List": handler})])
        self.server.add_insecure_port(f"unix://{socket_path}")

    @property
    def calls(self) -> int:
        return len(self.requests)

    def _list(self, request: bytes, context) -> bytes:
        self.requests.append(request)
        time.sleep(self.delay)
        return self.response

    def start(self) -> FakeKubelet:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(None).wait()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for sockets (unix socket paths are limited to 107 bytes; pytest's are long)."""
    path = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(socket_dir: Path, monkeypatch) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(socket_dir / "kubelet.sock").start()
    monkeypatch.setattr(podresources, "_kubelet", podresources.Kubelet(str(fake.socket_path), refresh=5.0))
    yield fake
    fake.stop()


def pod_info(rig: Rig) -> set[tuple[str, ...]]:
    return {(s["gpu"], s["pod"], s["namespace"], s["container"], s.get("gpu_instance", ""))
            for s in rig.series("nvml_gpu_pod_info")}


def test_a_real_kubelet_answer_maps_gpus_mig_devices_and_replicas_and_skips_what_it_does_not_read():
    holders, dropped = podresources.device_holders(podresources.pods(KUBELET_RESPONSE))
    assert dropped == 0
    trainer, notebook = (podresources.Holder("trainer-0", "ml", "pytorch"),
                         podresources.Holder("notebook", "research", "jupyter"))
    assert holders == {WHOLE_GPU: (trainer, notebook), "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee": (trainer,),
                       "eth7": (trainer,)}


def test_pod_info_names_each_gpus_pod_and_follows_it_without_touching_gpu_series(kubelet):
    rig = Rig(gpus=2, collectors=["utilization", "podresources"])
    gpu0, gpu1 = (device.uuid for device in rig.sampler.devices)
    kubelet.response = listing(("trainer-0", "ml", {"pytorch": [gpu0]}), ("trainer-1", "ml", {"pytorch": [gpu1]}))
    rig.step()
    assert pod_info(rig) == {("0", "trainer-0", "ml", "pytorch", ""), ("1", "trainer-1", "ml", "pytorch", "")}
    assert {s["uuid"] for s in rig.series("nvml_gpu_pod_info")} == {gpu0, gpu1}
    assert kubelet.requests == [b""]  # one kubelet call serves every GPU; its request is empty
    utilization_labels = sorted(map(sorted, (s.items() for s in rig.series("nvml_gpu_utilization_ratio"))))

    kubelet.response = listing(("eval-7", "research", {"main": [gpu1]}))  # trainer pods gone, GPU 1 reassigned
    for _ in range(4):
        rig.step()
    assert pod_info(rig) == {("0", "trainer-0", "ml", "pytorch", ""), ("1", "trainer-1", "ml", "pytorch", "")}
    rig.step()  # 5 s after the first call: refreshed
    assert pod_info(rig) == {("1", "eval-7", "research", "main", "")}
    assert kubelet.calls == 2
    assert sorted(map(sorted, (s.items() for s in rig.series("nvml_gpu_utilization_ratio")))) == utilization_labels
    assert rig.value("nvml_exporter_collector_success", collector="podresources") == 1


def test_mig_devices_map_to_their_parent_gpu_and_gpu_instance(kubelet):
    rig = Rig(gpus=2, devices={1: DeviceTraits(mig=True)}, collectors=["memory", "podresources"])
    parent = rig.lib.nvmlDeviceGetHandleByIndex(1)
    mig_a, mig_b = (str(rig.lib.nvmlDeviceGetUUID(rig.lib.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)))
                    for slot in (0, 1))  # the simulator's GPU instances 1 and 2
    kubelet.response = listing(("small-a", "ml", {"worker": [mig_a]}), ("small-b", "ml", {"worker": [mig_b]}),
                               ("big", "ml", {"worker": [rig.sampler.devices[0].uuid]}))
    rig.step()
    assert pod_info(rig) == {("0", "big", "ml", "worker", ""), ("1", "small-a", "ml", "worker", "1"),
                             ("1", "small-b", "ml", "worker", "2")}
    mig = {s["mig_uuid"]: s["uuid"] for s in rig.series("nvml_gpu_pod_info") if s.get("mig_uuid")}
    assert mig == {mig_a: rig.sampler.devices[1].uuid, mig_b: rig.sampler.devices[1].uuid}
    assert rig.series("nvml_exporter_errors_total") == []  # empty MIG slots are not errors


def test_unreachable_kubelet_warns_once_counts_each_failed_call_and_recovers(socket_dir, monkeypatch, caplog):
    path = socket_dir / "kubelet.sock"
    monkeypatch.setattr(podresources, "_kubelet", podresources.Kubelet(str(path), refresh=5.0))
    rig = Rig(gpus=2, collectors=["utilization", "podresources"])
    with caplog.at_level(logging.INFO, logger=podresources.__name__):
        for _ in range(11):  # calls at 1 s, 6 s and 11 s
            rig.step()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
        assert rig.value("nvml_exporter_errors_total", collector="podresources", error="unavailable") == 3
        assert rig.value("nvml_exporter_collector_success", collector="podresources") == 0
        assert rig.value("nvml_exporter_collector_success", collector="utilization") == 1
        assert rig.series("nvml_gpu_pod_info") == []

        fake = FakeKubelet(path, listing(("late", "ml", {"c": [rig.sampler.devices[0].uuid]}))).start()
        try:
            for _ in range(5):
                rig.step()
            assert pod_info(rig) == {("0", "late", "ml", "c", "")}
            assert rig.value("nvml_exporter_collector_success", collector="podresources") == 1
            assert any("answers again" in r.getMessage() for r in caplog.records)
            assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        finally:
            fake.stop()


def test_the_collector_reads_the_kubelet_without_the_protobuf_package(kubelet):
    """The kubernetes extra is grpcio alone: with protobuf made unimportable, a List call still maps GPUs."""
    kubelet.response = KUBELET_RESPONSE
    script = ("import sys; sys.modules['google.protobuf'] = None  # import google.protobuf raises\n"
              "from exporter.collectors import podresources\n"
              f"holders, dropped = podresources.Kubelet({str(kubelet.socket_path)!r}).ask()\n"
              "print(*sorted(holders), dropped)")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [WHOLE_GPU, "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "eth7", "0"]


def many_pods(count: int, device_id: str) -> bytes:
    """A ListPodResourcesResponse of `count` pods p000000... each holding `device_id` (repeated fields concatenate)."""
    one = listing(("p000000", "ml", {"c": [device_id]}))
    return b"".join(one.replace(b"p000000", f"p{n:06d}".encode()) for n in range(count))


def test_pods_per_gpu_are_bounded_and_the_dropped_ones_counted_and_logged_once(kubelet, caplog):
    rig = Rig(gpus=2, collectors=["utilization", "podresources"])
    gpu0, gpu1 = (device.uuid for device in rig.sampler.devices)
    kubelet.response = many_pods(1000, gpu0) + listing(("trainer-1", "ml", {"pytorch": [gpu1]}))
    with caplog.at_level(logging.WARNING, logger=podresources.__name__):
        for _ in range(6):  # kubelet calls at 1 s and 6 s
            rig.step()
    by_gpu = [s["gpu"] for s in rig.series("nvml_gpu_pod_info")]
    assert by_gpu.count("0") == podresources.MAX_HOLDERS_PER_DEVICE and by_gpu.count("1") == 1
    assert rig.value("nvml_exporter_errors_total", collector="podresources", error="too_many_pods") == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{1000 - podresources.MAX_HOLDERS_PER_DEVICE} dropped" in warnings[0]


def test_an_oversized_kubelet_reply_is_refused_not_parsed(kubelet, caplog):
    rig = Rig(gpus=1, collectors=["utilization", "podresources"])
    kubelet.response = many_pods(200_000, rig.sampler.devices[0].uuid)  # 15 MiB: past the 11 MiB reply reported
    assert len(kubelet.response) > podresources.MAX_RESPONSE_BYTES
    rig.step()
    assert rig.series("nvml_gpu_pod_info") == []
    assert rig.value("nvml_exporter_errors_total", collector="podresources", error="resource_exhausted") == 1
    assert rig.value("nvml_exporter_errors_total", collector="podresources", error="timeout") is None
    assert rig.value("nvml_exporter_collector_success", collector="utilization") == 1


def scrape_with(service: processes.Service, text: str) -> str | None:
    """The exporter's exposition if it contains `text`, else None."""
    body = requests.get(service.url + "/metrics", timeout=2).text
    return body if text in body else None


@pytest.mark.parametrize("response, delay, error", [
    (b"\x0a\xff\xff\xff\xff", 0.0, "invalid_response"),  # a length with no end
    (KUBELET_RESPONSE[:-7], 0.0, "invalid_response"),  # cut short inside a device id
    (listing(("p", "ml", {"c": ["GPU-abc"]})).replace(b"GPU-abc", b"GPU-\xff\xfe\xfd"), 0.0,
     "invalid_response"),  # a device id that is not UTF-8
    (b"", 2.0, "deadline_exceeded"),  # a kubelet that does not answer in time
], ids=["garbage", "truncated", "not-utf8", "hanging"])
def test_a_broken_kubelet_costs_one_bounded_call_and_a_counted_error(socket_dir, monkeypatch, caplog, response,
                                                                      delay, error):
    fake = FakeKubelet(socket_dir / "kubelet.sock", response, delay).start()
    try:
        monkeypatch.setattr(podresources, "_kubelet",
                            podresources.Kubelet(str(fake.socket_path), refresh=5.0, timeout=0.3))
        rig = Rig(gpus=2, collectors=["utilization", "podresources"])
        started = time.monotonic()
        with caplog.at_level(logging.DEBUG):
            rig.step()
        assert time.monotonic() - started < 1.5
        assert rig.value("nvml_exporter_errors_total", collector="podresources", error=error) == 1
        assert rig.value("nvml_exporter_collector_success", collector="podresources") == 0
        assert rig.series("nvml_gpu_pod_info") == [] and rig.value("nvml_up") == 1
        assert [r.getMessage() for r in caplog.records if r.exc_info] == []  # one warning, no traceback
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    finally:
        fake.stop()


def test_daemon_serves_pod_info_from_the_kubelet_socket_flag(tmp_path, socket_dir, start_service):
    uuid = simulated_uuid(0)
    kubelet = FakeKubelet(socket_dir / "kubelet.sock", listing(("trainer-0", "ml", {"pytorch": [uuid]}))).start()
    missing = socket_dir / "absent.sock"
    try:
        served = start_service(processes.exporter(tmp_path, [
            "--simulate=healthy", "--simulate.gpus=2", "--collector.podresources",
            f"--collector.podresources.socket={kubelet.socket_path}"]))
        body = processes.wait_until(lambda: scrape_with(served, "nvml_gpu_pod_info{"), 20, what="nvml_gpu_pod_info")
        assert f'nvml_gpu_pod_info{{container="pytorch",gpu="0",gpu_instance="",mig_uuid="",namespace="ml",' \
               f'pod="trainer-0",uuid="{uuid}"}} 1.0' in body
        check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr

        blind = start_service(processes.exporter(tmp_path, [
            "--simulate=healthy", "--simulate.gpus=2", "--collector.podresources",
            f"--collector.podresources.socket={missing}"]))
        failed = 'nvml_exporter_collector_success{collector="podresources"} 0.0'
        processes.wait_until(lambda: scrape_with(blind, failed), 20, what="podresources failure reported")
        assert blind.running()
        log = blind.log_path.read_text()
        warnings = [line for line in log.splitlines() if "WARNING exporter.collectors.podresources" in line]
        assert len(warnings) == 1 and str(missing) in warnings[0] and "Traceback" not in log
    finally:
        kubelet.stop()
