"""Which pod holds each GPU: the kubelet's pod-resources API, served as `nvml_gpu_pod_info`.

The kubelet answers gRPC `v1.PodResourcesLister/List` on a unix socket
(/var/lib/kubelet/pod-resources/kubelet.sock): every pod on the node, its containers and the device
ids each container holds. The NVIDIA device plugin names devices by UUID: `GPU-...` for a whole GPU,
`MIG-...` for a MIG device, `GPU-...::<n>` for a time-sliced replica. Each GPU's collector emits one
`nvml_gpu_pod_info{gpu,uuid,pod,namespace,container} 1` per container holding the GPU (a MIG device
adds `gpu_instance` and `mig_uuid`), so the GPU's own series keep their labels when the pod changes
and PromQL joins on `uuid`.

One kubelet call serves every GPU: the first GPU sampler that finds the listing older than
`refresh` seconds asks the kubelet (with a timeout), the others reuse the listing and never wait. While the kubelet
cannot be asked, no pod series are served, the collector reports failure and the error is counted
once per failed call; the warning is logged once per outage.

The kubelet's answer is bounded: a reply over MAX_RESPONSE_BYTES is refused (`resource_exhausted`),
parsing it counts against the same deadline as the call (`deadline_exceeded`), and each device keeps
at most MAX_HOLDERS_PER_DEVICE containers (the others are dropped: `too_many_pods` counted per call,
a warning logged once while it lasts), so one hostile or broken listing cannot flood Prometheus.

Off by default (`--collector.podresources`); it needs the `kubernetes` extra (grpcio). The request is
empty; the answer's bytes are read here (exporter/protowire.py, no protobuf package) with the v1 API's
field numbers (k8s.io/kubelet pkg/apis/podresources/v1/api.proto): ListPodResourcesResponse
{pod_resources = 1}, PodResources {name = 1, namespace = 2, containers = 3}, ContainerResources
{name = 1, devices = 2}, ContainerDevices {device_ids = 2}. Every other field the kubelet sends is
skipped unread. An answer that is not such a message (truncated, a length past its end, a string that is
not UTF-8...) fails the call as `invalid_response`, like any other kubelet failure.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from exporter import protowire
from exporter.collectors.base import Collector, SampleContext
from exporter.nvml import Absent, CallFailed, Device

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
REFRESH_SECONDS = 10.0
TIMEOUT_SECONDS = 1.0  # well under the sampler's hang watchdog (2 s at least)
LIST_METHOD = "/v1.PodResourcesLister/List"
EMPTY_REQUEST = b""  # a serialized ListPodResourcesRequest (it has no fields)
MAX_RESPONSE_BYTES = 4 * 2**20  # ~100 bytes per container and device: tens of thousands of pods
MAX_HOLDERS_PER_DEVICE = 32  # containers sharing one GPU (time-slicing replicas, MPS) served per device


class NotInstalled(Exception):
    """grpcio is missing: the collector cannot run."""


def grpc_module() -> Any:
    """The grpc package; raises NotInstalled."""
    try:
        import grpc
    except ImportError as exc:
        raise NotInstalled("--collector.podresources needs grpcio: pip install 'dualtrack[kubernetes]'") from exc
    return grpc


@dataclass(frozen=True)
class Holder:
    pod: str
    namespace: str
    container: str


@dataclass(frozen=True)
class Listing:
    """The kubelet's answer: holders by device id (replica suffixes removed); `ok` False when it failed;
    `dropped`: holders left out beyond MAX_HOLDERS_PER_DEVICE."""

    ok: bool = False
    holders: dict[str, tuple[Holder, ...]] = field(default_factory=dict)
    generation: int = 0
    dropped: int = 0


class ParseDeadlineExceeded(TimeoutError):
    """Reading the kubelet's answer took longer than the call's deadline."""


@dataclass(frozen=True)
class Pod:
    """One PodResources of the answer: the device ids each container holds (of every resource)."""

    name: str
    namespace: str
    containers: tuple[tuple[str, tuple[str, ...]], ...]  # (container name, device ids)


def pods(response: bytes) -> Iterator[Pod]:
    """The pods of a serialized ListPodResourcesResponse, read one at a time; raises
    protowire.MalformedMessage."""
    for number, value in protowire.length_delimited(response):
        if number == 1:
            yield _pod(value)


def _pod(message: bytes) -> Pod:
    name = namespace = ""
    containers = []
    for number, value in protowire.length_delimited(message):
        if number == 1:
            name = protowire.string(value)
        elif number == 2:
            namespace = protowire.string(value)
        elif number == 3:
            containers.append(_container(value))
    return Pod(name, namespace, tuple(containers))


def _container(message: bytes) -> tuple[str, tuple[str, ...]]:
    name = ""
    device_ids: list[str] = []
    for number, value in protowire.length_delimited(message):
        if number == 1:
            name = protowire.string(value)
        elif number == 2:  # ContainerDevices: resource_name = 1 (not read), device_ids = 2
            device_ids.extend(protowire.string(device_id) for device_number, device_id
                              in protowire.length_delimited(value) if device_number == 2)
    return name, tuple(device_ids)


def device_holders(listed: Iterable[Pod], limit: int = MAX_HOLDERS_PER_DEVICE,
                   deadline: float | None = None) -> tuple[dict[str, tuple[Holder, ...]], int]:
    """Holders by device id from the pods listed, at most `limit` per device, and how many were dropped;
    `GPU-x::3` (a time-sliced replica) counts as `GPU-x`. Raises ParseDeadlineExceeded past `deadline`
    (time.monotonic)."""
    holders: dict[str, dict[Holder, None]] = {}
    dropped = 0
    for pod in listed:
        if deadline is not None and time.monotonic() > deadline:
            raise ParseDeadlineExceeded("the kubelet's answer took too long to read")
        for container, device_ids in pod.containers:
            holder = Holder(pod.name, pod.namespace, container)
            for device_id in device_ids:
                found = holders.setdefault(device_id.split("::", 1)[0], {})
                if holder in found:
                    continue
                if len(found) >= limit:
                    dropped += 1
                    continue
                found[holder] = None
    return {device_id: tuple(found) for device_id, found in holders.items()}, dropped


class Kubelet:
    """The node's pod-resources listing, asked for at most every `refresh` seconds by whichever GPU needs it."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, refresh: float = REFRESH_SECONDS,
                 timeout: float = TIMEOUT_SECONDS) -> None:
        self.socket_path = socket_path
        self.refresh = refresh
        self.timeout = timeout
        self.listing = Listing()
        self._asked_at: float | None = None
        self._lock = threading.Lock()
        self._failing = False
        self._dropping = False

    def current(self, now: float) -> tuple[Listing, str | None]:
        """The latest listing, refreshed first when due; plus the error of the call made here, if one failed.

        While one GPU's sampler asks the kubelet, the others take the previous listing instead of waiting.
        """
        if not self._lock.acquire(blocking=False):
            return self.listing, None
        try:
            if self._asked_at is not None and now - self._asked_at < self.refresh:
                return self.listing, None
            self._asked_at = now
            error = None
            try:
                holders, dropped = self.ask()
                listing = Listing(True, holders, self.listing.generation + 1, dropped)
            except Exception as exc:  # noqa: BLE001 - whatever the kubelet does, the sampler goes on
                error = _error_name(exc)
                listing = Listing(False, {}, self.listing.generation + 1)
                if not self._failing:
                    log.warning("kubelet pod-resources at %s cannot be read (%s): no nvml_gpu_pod_info until it "
                                "answers", self.socket_path, _describe(exc))
            else:
                if self._failing:
                    log.info("kubelet pod-resources at %s answers again", self.socket_path)
                if listing.dropped:
                    error = "too_many_pods"
                    if not self._dropping:
                        log.warning("kubelet pod-resources at %s lists more than %d containers for a device: %d "
                                    "dropped from nvml_gpu_pod_info (counted as too_many_pods while it lasts)",
                                    self.socket_path, MAX_HOLDERS_PER_DEVICE, listing.dropped)
                self._dropping = listing.dropped > 0
            self._failing = not listing.ok
            self.listing = listing
            return listing, error
        finally:
            self._lock.release()

    def ask(self) -> tuple[dict[str, tuple[Holder, ...]], int]:
        """One List call over a fresh channel (a kubelet restart then costs no reconnect backoff), read within
        the same deadline: (holders by device id, holders dropped)."""
        grpc = grpc_module()
        deadline = time.monotonic() + self.timeout
        options = [("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)]
        with grpc.insecure_channel(f"unix://{self.socket_path}", options=options) as channel:
            # bytes in and out: grpc's own deserializer would log a traceback for a malformed answer
            response = channel.unary_unary(LIST_METHOD)(EMPTY_REQUEST, timeout=self.timeout)
        return device_holders(pods(response), deadline=deadline)


def _error_name(exc: BaseException) -> str:
    """unavailable, deadline_exceeded, unimplemented... for gRPC errors; the exception type otherwise."""
    if isinstance(exc, ParseDeadlineExceeded):
        return "deadline_exceeded"
    if isinstance(exc, protowire.MalformedMessage):
        return "invalid_response"
    code = getattr(exc, "code", None)
    status = code() if callable(code) else None
    return getattr(status, "name", "").lower() or type(exc).__name__.lower()


def _describe(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return f"{_error_name(exc)}: {text}" if text else _error_name(exc)


_kubelet = Kubelet()


def configure(socket_path: str, *, refresh: float = REFRESH_SECONDS, timeout: float = TIMEOUT_SECONDS) -> None:
    """Point the collector at the kubelet socket (one kubelet per node, so one per process); raises NotInstalled."""
    global _kubelet
    grpc_module()
    _kubelet = Kubelet(socket_path, refresh=refresh, timeout=timeout)


class PodResourcesCollector(Collector):
    """nvml_gpu_pod_info for the GPU and its MIG devices, from the shared kubelet listing."""

    name = "podresources"
    default_enabled = False
    help = ("pod, namespace and container holding each GPU or MIG device, from the kubelet pod-resources API "
            "(needs the kubernetes extra; see --collector.podresources.socket)")

    def __init__(self, device: Device, **options: Any) -> None:
        super().__init__(device, **options)
        self._generation = -1
        self._ids: list[tuple[str, str, str]] = []  # (device id, gpu_instance, mig_uuid)

    def collect(self, ctx: SampleContext) -> None:
        listing, error = _kubelet.current(ctx.now)
        if error:
            ctx.errors.append(error)
        if not listing.ok:
            return
        if listing.generation != self._generation:  # MIG devices are re-read with each new listing
            self._generation = listing.generation
            self._ids = [(self.device.uuid, "", "")] + self._mig_devices(ctx)
        for device_id, gpu_instance, mig_uuid in self._ids:
            for holder in listing.holders.get(device_id, ()):
                ctx.emit("nvml_gpu_pod_info", 1, holder.pod, holder.namespace, holder.container, gpu_instance,
                         mig_uuid)

    def _mig_devices(self, ctx: SampleContext) -> list[tuple[str, str, str]]:
        if self.device.mig_mode != "enabled":
            return []
        found = []
        nvml = self.device.nvml
        for slot in range(ctx.call("nvmlDeviceGetMaxMigDeviceCount") or 0):
            try:
                handle = self.device.call("nvmlDeviceGetMigDeviceHandleByIndex", slot)
            except Absent:
                break
            except CallFailed as exc:  # not_found: an empty slot
                if exc.error != "not_found":
                    ctx.errors.append(exc.error)
                continue
            mig_uuid = ctx.guarded(partial(nvml.call, "nvmlDeviceGetUUID", handle))
            instance = ctx.guarded(partial(nvml.call, "nvmlDeviceGetGpuInstanceId", handle))
            if mig_uuid is not None:
                text = mig_uuid.decode() if isinstance(mig_uuid, bytes) else str(mig_uuid)
                found.append((text, "" if instance is None else str(instance), text))
        return found
