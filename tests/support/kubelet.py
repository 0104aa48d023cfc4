"""The kubelet's side of pod-resources for the tests: the v1 API's List messages built with the real
protobuf package (trainer_hook.protobuf), to encode what a kubelet sends and to cross-check the exporter's
own reader against protobuf's."""
from __future__ import annotations

import functools

from trainer_hook import protobuf
from trainer_hook.protobuf import MESSAGE, STRING, Schema

#: message -> (field name, number, type, repeated, message type) of k8s.io/kubelet
#: pkg/apis/podresources/v1/api.proto, List's part only
V1_SCHEMA: Schema = {
    "ListPodResourcesRequest": (),
    "ListPodResourcesResponse": (("pod_resources", 1, MESSAGE, True, "PodResources"),),
    "PodResources": (("name", 1, STRING, False, ""), ("namespace", 2, STRING, False, ""),
                     ("containers", 3, MESSAGE, True, "ContainerResources")),
    "ContainerResources": (("name", 1, STRING, False, ""), ("devices", 2, MESSAGE, True, "ContainerDevices")),
    "ContainerDevices": (("resource_name", 1, STRING, False, ""), ("device_ids", 2, STRING, True, "")),
}


@functools.cache
def v1_messages() -> dict[str, type]:
    """The message classes of V1_SCHEMA, by name."""
    return protobuf.messages("kubelet/podresources/v1/api.proto", "v1", V1_SCHEMA)


def listing(*pods: tuple[str, str, dict[str, list[str]]]) -> bytes:
    """A serialized ListPodResourcesResponse: (pod, namespace, {container: [device ids]}) per pod."""
    response = v1_messages()["ListPodResourcesResponse"]()
    for name, namespace, containers in pods:
        pod = response.pod_resources.add(name=name, namespace=namespace)
        for container, device_ids in containers.items():
            pod.containers.add(name=container).devices.add(resource_name="nvidia.com/gpu", device_ids=device_ids)
    return response.SerializeToString()
