"""The shipped deployment files read as data: docker-compose.yml's services and their mounts, the
Kubernetes base (deploy/kubernetes) with its components applied."""
from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import yaml

from tests.support.paths import REPO

COMPOSE = REPO / "docker-compose.yml"


@lru_cache(maxsize=1)
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def services() -> dict[str, dict]:
    return compose()["services"]


def mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, container target, read-only) of every volume of `service`, short or long syntax."""
    found = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            found.append((volume["source"], volume["target"], bool(volume.get("read_only"))))
        else:
            source, target, *options = volume.split(":")
            found.append((source, target, "ro" in options))
    return found


def bind_mounts(service: dict) -> list[tuple[str, str]]:
    """(repo-relative source, container target) of every bind mount of `service`."""
    return [(source, target) for source, target, _ in mounts(service) if source.startswith((".", "/"))]


KUBE = REPO / "deploy" / "kubernetes"


def kustomization(path: Path = KUBE) -> dict:
    return yaml.safe_load((path / "kustomization.yaml").read_text())


def objects() -> list[dict]:
    """Every object of the base, in kustomization order (each names its namespace: the kustomization does not)."""
    return [document for resource in kustomization()["resources"]
            for document in yaml.safe_load_all((KUBE / resource).read_text()) if document]


def find(kind: str, name: str, documents: list[dict] | None = None) -> dict:
    return next(d for d in documents or objects() if d["kind"] == kind and d["metadata"]["name"] == name)


def with_components(*names: str) -> list[dict]:
    """The base with the components' resources and JSON6902 patches applied (`add` and `replace`, all
    they use)."""
    documents = copy.deepcopy(objects())
    for name in names:
        component = kustomization(KUBE / "components" / name)
        for resource in component.get("resources", []):
            documents += yaml.safe_load_all((KUBE / "components" / name / resource).read_text())
        for patch in component.get("patches", []):
            target = find(patch["target"]["kind"], patch["target"]["name"], documents)
            for operation in yaml.safe_load(patch["patch"]):
                assert operation["op"] in ("add", "replace"), operation
                *parents, last = [int(p) if p.isdigit() else p.replace("~1", "/").replace("~0", "~")
                                  for p in operation["path"].strip("/").split("/")]
                node = target
                for part in parents:
                    node = node[part]
                if last == "-":
                    node.append(operation["value"])
                else:
                    assert operation["op"] == "add" or last in node, operation  # replace needs the key
                    node[last] = operation["value"]
    return documents
