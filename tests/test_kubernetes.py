"""The Kubernetes manifests (deploy/kubernetes), checked offline: schemas, selectors, generated files, rules."""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
KUBE = REPO / "deploy" / "kubernetes"
sys.path.insert(0, str(KUBE))
import generate  # noqa: E402

BUILT_IN = {"Namespace", "DaemonSet", "Service", "PersistentVolumeClaim", "Deployment", "CronJob", "ConfigMap"}
#: Components for the kustomization of the training workloads, not of dualtrack's base.
TRAINING_COMPONENTS = ("remote-write",)
COMPONENTS = sorted(p.parent.name for p in (KUBE / "components").glob("*/kustomization.yaml")
                    if p.parent.name not in TRAINING_COMPONENTS)


def kustomization(path: Path = KUBE) -> dict:
    return yaml.safe_load((path / "kustomization.yaml").read_text())


def objects() -> list[dict]:
    """Every object of the base, in kustomization order, with the kustomization's namespace applied."""
    out = []
    for resource in kustomization()["resources"]:
        for document in yaml.safe_load_all((KUBE / resource).read_text()):
            if document:
                if document["kind"] != "Namespace":
                    document["metadata"].setdefault("namespace", kustomization()["namespace"])
                out.append(document)
    return out


def find(kind: str, name: str, documents: list[dict] | None = None) -> dict:
    return next(d for d in documents or objects() if d["kind"] == kind and d["metadata"]["name"] == name)


def with_components(*names: str) -> list[dict]:
    """The base with the components' resources and JSON6902 patches applied (`add` and `replace`, all
    they use)."""
    documents = copy.deepcopy(objects())
    for name in names:
        component = kustomization(KUBE / "components" / name)
        for resource in component.get("resources", []):
            for document in yaml.safe_load_all((KUBE / "components" / name / resource).read_text()):
                document["metadata"].setdefault("namespace", kustomization()["namespace"])
                documents.append(document)
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


def test_generated_prometheus_rule_and_dashboards_match_their_sources():
    """rules/*.yml and dashboards/*.json are the only sources: the committed objects must be what the script makes."""
    result = subprocess.run([sys.executable, str(KUBE / "generate.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (KUBE / "prometheusrule.yaml").read_text() == generate.prometheus_rule()
    assert (KUBE / "grafana-dashboards.yaml").read_text() == generate.dashboard_configmaps()


def test_check_mode_fails_when_a_rule_changes_without_regenerating(tmp_path, monkeypatch):
    rules = tmp_path / "rules"
    shutil.copytree(REPO / "rules", rules)
    (rules / "zz-new.yml").write_text("groups:\n  - name: new\n    rules:\n      - record: job:up:sum\n"
                                      "        expr: sum by (job) (up)\n")
    monkeypatch.setattr(generate, "RULES", rules)
    assert generate.main(["--check"]) == 1


def test_prometheus_rule_groups_pass_promtool(tmp_path):
    spec = find("PrometheusRule", "dualtrack")["spec"]
    assert {g["name"] for g in spec["groups"]} == {g["name"] for path in (REPO / "rules").glob("*.yml")
                                                   for g in yaml.safe_load(path.read_text())["groups"]}
    extracted = tmp_path / "rules.yml"
    extracted.write_text(yaml.safe_dump(spec))
    result = subprocess.run(["promtool", "check", "rules", str(extracted)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_configmaps_carry_each_dashboard_for_the_sidecar():
    maps = [d for d in objects() if d["kind"] == "ConfigMap"]
    assert len(maps) == len(list((REPO / "dashboards").glob("*.json")))
    for configmap in maps:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        (name, text), = configmap["data"].items()
        dashboard, source = json.loads(text), json.loads((REPO / "dashboards" / name).read_text())
        assert dashboard["uid"] == source["uid"] and len(dashboard["panels"]) == len(source["panels"])
        assert "dualtrack-prometheus" not in text  # the compose stack's provisioned uid and '"uid": "${datasource}"' in text


@pytest.mark.parametrize("components", [(), tuple(COMPONENTS)], ids=["base", "all-components"])
def test_built_in_kinds_pass_the_kubernetes_schemas_strictly(tmp_path, components):
    documents = [d for d in with_components(*components) if d["kind"] in BUILT_IN]
    assert {d["kind"] for d in documents} == BUILT_IN
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump_all(documents))
    result = subprocess.run([str(Path(sys.executable).with_name("kubernetes-validate")), "--strict", "--quiet",
                             "-k", "1.29", str(manifest)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_service_monitor_selects_a_service_and_its_port():
    documents = objects()
    services = [d for d in documents if d["kind"] == "Service"]
    monitors = [d for d in documents if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"dualtrack-exporter", "pushgateway"}
    for monitor in monitors:
        wanted = monitor["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()
                   and s["metadata"]["namespace"] == monitor["metadata"]["namespace"]]
        assert len(matched) == 1, monitor["metadata"]["name"]
        service = matched[0]
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
        pods = [d for d in documents if d["kind"] in ("DaemonSet", "Deployment")
                and service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, service["metadata"]["name"]
        container_ports = {p["name"] for c in pods[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports


def test_the_exporter_job_name_is_the_one_the_alerts_select():
    assert 'up{job="dualtrack-exporter"}' in (REPO / "rules" / "alerts.yml").read_text()
    assert find("Service", "dualtrack-exporter")["metadata"]["name"] == "dualtrack-exporter"
    assert "jobLabel" not in find("ServiceMonitor", "dualtrack-exporter")["spec"]


def test_exporter_daemonset_runs_on_gpu_nodes_unprivileged_with_measured_resources():
    spec = find("DaemonSet", "dualtrack-exporter")["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert any(e["key"] == "nvidia.com/gpu.present" for t in terms for e in t["matchExpressions"])
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert "hostPID" not in spec and "runtimeClassName" not in spec and spec["volumes"] == []
    container, = spec["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])  # takes no GPU from workloads
    assert set(container["resources"]) == {"requests", "limits"}


def test_components_add_the_runtime_class_host_pid_pod_attribution_and_the_kernel_log():
    enforce = "pod-security.kubernetes.io/enforce"
    assert find("Namespace", "dualtrack")["metadata"]["labels"][enforce] == "baseline"
    for component in ("host-pid", "pod-attribution", "kernel-log"):  # hostPID and hostPath are not "baseline"
        assert find("Namespace", "dualtrack", with_components(component))["metadata"]["labels"][enforce] == \
            "privileged"
    spec = find("DaemonSet", "dualtrack-exporter", with_components(*COMPONENTS))["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia" and spec["hostPID"] is True
    container, = spec["containers"]
    assert "--collector.podresources" in container["args"]
    mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume["hostPath"] for volume in spec["volumes"]}
    assert set(mounts) == set(volumes) == {"pod-resources", "kmsg"} and all(m["readOnly"] for m in mounts.values())
    assert mounts["pod-resources"]["mountPath"] == volumes["pod-resources"]["path"] == "/var/lib/kubelet/pod-resources"
    # /dev/kmsg needs CAP_SYSLOG, which Kubernetes gives to uid 0 only: that one capability, nothing else
    assert mounts["kmsg"]["mountPath"] == volumes["kmsg"]["path"] == "/dev/kmsg"
    assert volumes["kmsg"]["type"] == "CharDevice" and spec["securityContext"]["runAsUser"] == 0
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"], "add": ["SYSLOG"]}}


def test_pushgateway_is_persistent_authenticated_and_the_janitor_uses_the_hooks_environment():
    deployment = find("Deployment", "pushgateway")["spec"]["template"]["spec"]
    args = deployment["containers"][0]["args"]
    data = next(m for m in deployment["containers"][0]["volumeMounts"] if m["name"] == "data")
    assert f"--persistence.file={data['mountPath']}/pushgateway.store" in args
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "pushgateway-data"
               for v in deployment["volumes"])
    web = next(m for m in deployment["containers"][0]["volumeMounts"] if m["name"] == "web")
    assert f"--web.config.file={web['mountPath']}/web-config.yml" in args
    monitor = find("ServiceMonitor", "pushgateway")["spec"]["endpoints"][0]
    assert monitor["honorLabels"] is True and monitor["scheme"] == "https" and "basicAuth" in monitor

    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    assert deployment["containers"][0]["image"] == compose["pushgateway"]["image"]  # the same digest

    janitor = find("CronJob", "dualtrack-janitor")["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    pod = find("CronJob", "dualtrack-janitor")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    password_mount = next(m for m in janitor["volumeMounts"] if m["name"] == "hook")["mountPath"]
    assert janitor["command"] == ["dualtrack", "janitor", "--once",
                                  f"--pushgateway-password-file={password_mount}/password"]
    env = {e["name"] for e in janitor["env"]}
    # the password is a file, never in the environment; the janitor is not the exporter's uid
    assert env == {"DUALTRACK_PUSHGATEWAY", "DUALTRACK_PUSHGATEWAY_USERNAME", "DUALTRACK_PUSHGATEWAY_CA_FILE"}
    # the names the hook reads: $DUALTRACK_PUSHGATEWAY and the connection rule's <prefix>_USERNAME, _CA_FILE
    from trainer_hook.settings import ENV_PUSHGATEWAY
    connection = (REPO / "trainer_hook" / "connection.py").read_text()
    for name in env:
        suffix = name.removeprefix(ENV_PUSHGATEWAY)
        assert name.startswith(ENV_PUSHGATEWAY) and (not suffix or f'{{env_prefix}}{suffix}"' in connection), name
    exporter_pod = find("DaemonSet", "dualtrack-exporter")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] != exporter_pod["securityContext"]["runAsUser"]
    hook_volume = next(v for v in pod["volumes"] if v["name"] == "hook")["secret"]
    assert hook_volume["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    service = find("Service", "pushgateway")
    url = next(e["value"] for e in janitor["env"] if e["name"] == "DUALTRACK_PUSHGATEWAY")
    assert url == f"https://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:" \
                  f"{service['spec']['ports'][0]['port']}"


def test_kustomization_lists_every_manifest_once():
    listed = kustomization()["resources"]
    assert len(listed) == len(set(listed))
    assert set(listed) == {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_scaling_guide_configs_pass_promtool(tmp_path):
    """Every YAML example in docs/scaling.md: remote_write blocks as a Prometheus config, rule groups as rules."""
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "scaling.md").read_text(), re.DOTALL)
    checked = set()
    for i, block in enumerate(blocks):
        document = yaml.safe_load(block)
        kind = "config" if "remote_write" in document else "rules"
        path = tmp_path / f"{i}.yml"
        path.write_text(block)
        result = subprocess.run(["promtool", "check", kind, str(path)], capture_output=True, text=True)
        assert result.returncode == 0, block + result.stdout + result.stderr
        checked.add(kind)
    assert checked == {"config", "rules"} and len(blocks) >= 4


def test_the_exporter_accepts_the_daemonsets_arguments_and_the_socket_default_matches_the_mount():
    from exporter import kernellog
    from exporter.cli import parse_args
    container = find("DaemonSet", "dualtrack-exporter", with_components(*COMPONENTS))["spec"]["template"]["spec"][
        "containers"][0]
    assert container["command"] == ["dualtrack-exporter"]
    args = parse_args(container["args"], environ={e["name"]: e["value"] for e in container["env"]})
    assert args.collector_podresources and args.web_listen_address == ":9942"
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert Path(args.collector_podresources_socket).parent == Path(mounts["pod-resources"])
    assert args.collector_xid_kernel_log is None and kernellog.DEFAULT_PATH == mounts["kmsg"]  # the default path


def test_the_remote_write_component_points_labelled_training_workloads_at_the_url(tmp_path):
    """Built by kubectl's kustomize into a training kustomization: the labelled Job gets the URL from the
    generated ConfigMap, an unlabelled Deployment nothing; the URL is one the hook accepts."""
    from trainer_hook.settings import remote_write
    component = kustomization(KUBE / "components" / "remote-write")
    literal, = component["configMapGenerator"][0]["literals"]
    name, _, url = literal.partition("=")
    assert name == "DUALTRACK_REMOTE_WRITE_URL" and remote_write(url).url == url
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (kustomize) is not installed")
    (tmp_path / "workloads.yaml").write_text(yaml.safe_dump_all([
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train", "labels": {"dualtrack.io/training": "true"}},
         "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "t", "image": "x"}]}}}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "other"},
         "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
             "metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "y"}]}}}}]))
    relative = Path(*[".."] * len(tmp_path.parts[1:])) / KUBE.relative_to("/") / "components" / "remote-write"
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["workloads.yaml"], "components": [str(relative)]}))
    built = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    documents = {d["kind"]: d for d in yaml.safe_load_all(built.stdout)}
    config_map = documents["ConfigMap"]
    assert config_map["data"] == {"DUALTRACK_REMOTE_WRITE_URL": url}
    job, = documents["Job"]["spec"]["template"]["spec"]["containers"]
    assert job["envFrom"] == [{"configMapRef": {"name": config_map["metadata"]["name"]}}]
    assert "envFrom" not in documents["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_the_pod_monitor_scrapes_what_a_training_pod_serves_from_its_environment(monkeypatch, tmp_path):
    """The PodMonitor selects the label and port name its comment asks training pods for, and a hook
    given only DUALTRACK_LISTEN_PORT / _ADDRESS serves the series the rules need."""
    import requests
    from trainer_hook import TrainingMonitor
    monitor_spec = find("PodMonitor", "dualtrack-training", with_components("pod-monitor"))["spec"]
    assert monitor_spec["selector"]["matchLabels"] == {"dualtrack.io/training": "true"}
    assert monitor_spec["namespaceSelector"] == {"any": True}
    assert [e["port"] for e in monitor_spec["podMetricsEndpoints"]] == ["dualtrack-metrics"]
    text = (KUBE / "components" / "pod-monitor" / "kustomization.yaml").read_text()
    assert "DUALTRACK_LISTEN_PORT" in text and "dualtrack.io/training" in text
    monkeypatch.setenv("DUALTRACK_LISTEN_PORT", "0")
    monkeypatch.setenv("DUALTRACK_LISTEN_ADDRESS", "127.0.0.1")
    with TrainingMonitor(job="pods", run="r1", pushgateway=False, record_path=False) as monitor:
        monitor.log({"loss": 0.5}, step=1)
        assert monitor.listen_port
        served = requests.get(f"http://127.0.0.1:{monitor.listen_port}/metrics", timeout=10).text
    assert 'training_last_push_timestamp_seconds{rank="0",run="r1"}' in served
