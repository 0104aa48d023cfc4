"""The Kubernetes manifests (deploy/kubernetes), checked offline: schemas, selectors, generated files, rules."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.deploy import KUBE, find, kustomization, objects, with_components
from tests.support.paths import REPO

sys.path.insert(0, str(KUBE))
import generate

BUILT_IN = {"Namespace", "DaemonSet", "Service", "PersistentVolumeClaim", "Deployment", "CronJob", "ConfigMap",
            "NetworkPolicy"}
#: Components for the kustomization of the training workloads, not of dualtrack's base.
TRAINING_COMPONENTS = ("remote-write", "training-network-policy")
ENFORCE = "pod-security.kubernetes.io/enforce"
COMPONENTS = sorted(p.parent.name for p in (KUBE / "components").glob("*/kustomization.yaml")
                    if p.parent.name not in TRAINING_COMPONENTS)


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
        assert "dualtrack-prometheus" not in text  # the compose stack's provisioned uid
        assert '"uid": "${datasource}"' in text


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
    assert find("Namespace", "dualtrack-node")["metadata"]["labels"][ENFORCE] == "baseline"
    for component in ("host-pid", "pod-attribution", "kernel-log"):  # hostPID, hostPath, privileged: not "baseline"
        documents = with_components(component)
        assert find("Namespace", "dualtrack-node", documents)["metadata"]["labels"][ENFORCE] == "privileged"
        assert find("Namespace", "dualtrack", documents)["metadata"]["labels"][ENFORCE] == "restricted"
    spec = find("DaemonSet", "dualtrack-exporter", with_components(*COMPONENTS))["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia" and spec["hostPID"] is True
    exporter, _reader = spec["containers"]
    assert "--collector.podresources" in exporter["args"]
    mounts = {mount["name"]: mount for mount in exporter["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert set(mounts) == set(volumes) == {"pod-resources", "kernel-log"}
    assert all(m["readOnly"] for m in mounts.values())
    assert mounts["pod-resources"]["mountPath"] == volumes["pod-resources"]["hostPath"]["path"] == \
        "/var/lib/kubelet/pod-resources"
    # the kubelet's socket is root's: the exporter stays uid 0 there (no capability), not asked to drop it
    assert spec["securityContext"]["runAsUser"] == 0
    assert {"name": "DUALTRACK_EXPORTER_RUN_AS", "value": ""} in exporter["env"]
    assert exporter["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                           "capabilities": {"drop": ["ALL"]}}


def test_the_kernel_log_is_read_by_a_privileged_reader_without_ports_for_an_unprivileged_exporter():
    """A non-privileged container cannot open /dev/kmsg (the device cgroup: EPERM whatever its
    capabilities), so the reader is privileged, and the exporter follows what it copies."""
    from exporter.cli import parse_args
    from exporter.kernellog_copy import build_parser
    spec = find("DaemonSet", "dualtrack-exporter", with_components("kernel-log"))["spec"]["template"]["spec"]
    exporter, reader = spec["containers"]
    assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["runAsNonRoot"] is True
    assert exporter["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                           "capabilities": {"drop": ["ALL"]}}
    assert reader["securityContext"]["privileged"] is True and "ports" not in reader
    assert reader["image"] == exporter["image"] and reader["command"][:3] == ["python", "-m", "exporter.kernellog_copy"]
    copy = build_parser().parse_args(reader["command"][3:])
    followed = parse_args(exporter["args"], environ={e["name"]: e["value"] for e in exporter["env"]})
    assert copy.source == "/dev/kmsg" and copy.run_as == "10001:10001"
    shared = {m["name"]: m for m in reader["volumeMounts"]}["kernel-log"]
    read = {m["name"]: m for m in exporter["volumeMounts"]}["kernel-log"]
    assert read["readOnly"] is True and not shared.get("readOnly")
    assert Path(copy.target).parent == Path(shared["mountPath"]) == Path(read["mountPath"])
    assert followed.collector_xid_kernel_log == copy.target
    volume = {v["name"]: v for v in spec["volumes"]}["kernel-log"]
    assert volume == {"name": "kernel-log", "emptyDir": {"medium": "Memory", "sizeLimit": "4Mi"}}


def pod_templates(documents: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every Deployment, DaemonSet and CronJob."""
    out = []
    for document in documents:
        template = {"Deployment": lambda d: d["spec"]["template"], "DaemonSet": lambda d: d["spec"]["template"],
                    "CronJob": lambda d: d["spec"]["jobTemplate"]["spec"]["template"]}.get(document["kind"])
        if template:
            out.append((document, template(document)["spec"]))
    return out


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    """What of a pod spec the "restricted" Pod Security Standard (Kubernetes 1.29) refuses."""
    found = []
    pod_context = pod.get("securityContext", {})
    for key in ("hostPID", "hostIPC", "hostNetwork"):
        if pod.get(key):
            found.append(key)
    found += [f"volume {v['name']}" for v in pod.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    for container in pod.get("initContainers", []) + pod["containers"]:
        context, name = container.get("securityContext", {}), container["name"]
        merged = {**pod_context, **context}
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation")
        if merged.get("runAsNonRoot") is not True or merged.get("runAsUser") == 0:
            found.append(f"{name}: may run as root")
        if merged.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile")
        capabilities = context.get("capabilities", {})
        if capabilities.get("drop") != ["ALL"] or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


@pytest.mark.parametrize("components", [(), tuple(COMPONENTS)], ids=["base", "all-components"])
def test_every_pod_of_the_restricted_namespace_satisfies_the_restricted_profile(components):
    documents = with_components(*components)
    restricted = {d["metadata"]["name"] for d in documents if d["kind"] == "Namespace"
                  and d["metadata"]["labels"][ENFORCE] == "restricted"}
    assert restricted == {"dualtrack"}
    pods = [(w, pod) for w, pod in pod_templates(documents) if w["metadata"]["namespace"] in restricted]
    assert {w["metadata"]["name"] for w, _ in pods} == {"pushgateway", "dualtrack-janitor"}
    for workload, pod in pods:
        assert restricted_violations(pod) == [], workload["metadata"]["name"]
    # the exporter, with its host-facing components, lives in a namespace of its own
    exporter = find("DaemonSet", "dualtrack-exporter", documents)
    assert exporter["metadata"]["namespace"] == "dualtrack-node"
    if components:  # hostPID, a hostPath, a privileged reader: allowed there, and only there
        assert restricted_violations(exporter["spec"]["template"]["spec"])
    every_namespace = {d["metadata"]["name"] for d in documents if d["kind"] == "Namespace"}
    assert all(d["metadata"]["namespace"] in every_namespace for d in documents if d["kind"] != "Namespace")


def selected(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items() and not selector.get("matchExpressions")


def test_the_network_policies_select_their_pods_and_open_only_their_ports():
    documents = with_components("pod-monitor")
    policies = {p["metadata"]["name"]: p for p in documents if p["kind"] == "NetworkPolicy"}
    workloads = pod_templates(documents)
    expected = {"dualtrack-exporter": "dualtrack-exporter", "pushgateway": "pushgateway",
                "dualtrack-janitor": "dualtrack-janitor"}
    assert set(policies) == set(expected)
    for name, policy in policies.items():
        spec, namespace = policy["spec"], policy["metadata"]["namespace"]
        assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
        matched = [w for w, _ in workloads if w["metadata"]["namespace"] == namespace and selected(
            spec["podSelector"], (w["spec"].get("template") or w["spec"]["jobTemplate"]["spec"]["template"])[
                "metadata"]["labels"])]
        assert [w["metadata"]["name"] for w in matched] == [expected[name]], name
        pod = pod_templates(matched)[0][1]
        container_ports = {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
        assert {port["port"] for rule in spec["ingress"] for port in rule["ports"]} == container_ports, name
    # nothing the exporter or the Pushgateway may open; the janitor the Pushgateway's port and DNS alone
    assert policies["dualtrack-exporter"]["spec"]["egress"] == policies["pushgateway"]["spec"]["egress"] == []
    janitor = policies["dualtrack-janitor"]["spec"]
    assert janitor["ingress"] == [] and {p["port"] for rule in janitor["egress"] for p in rule["ports"]} == {9091, 53}
    pushgateway_port = find("Service", "pushgateway")["spec"]["ports"][0]["port"]
    assert pushgateway_port in {p["port"] for rule in janitor["egress"] for p in rule["ports"]}
    # who may push: Prometheus, the janitor and labelled training pods of any namespace
    sources = policies["pushgateway"]["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {}, "podSelector": {"matchLabels": {"dualtrack.io/training": "true"}}} in sources
    monitor = find("PodMonitor", "dualtrack-training", documents)["spec"]
    training = yaml.safe_load((KUBE / "components" / "training-network-policy" / "networkpolicy.yaml").read_text())
    assert training["spec"]["podSelector"] == monitor["selector"] and training["spec"]["policyTypes"] == ["Ingress"]
    ranks, scrape = training["spec"]["ingress"]
    assert ranks == {"from": [{"podSelector": monitor["selector"]}]}  # rendezvous and collectives, any port
    assert [p["port"] for p in scrape["ports"]] == [e["port"] for e in monitor["podMetricsEndpoints"]]


def test_kustomize_puts_each_object_in_its_namespace(tmp_path):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (kustomize) is not installed")
    relative = Path(*[".."] * len(tmp_path.parts[1:])) / KUBE.relative_to("/")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [str(relative)],
        "components": [str(relative / "components" / name) for name in COMPONENTS]}))
    built = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    where = {(d["kind"], d["metadata"]["name"]): d["metadata"].get("namespace")
             for d in yaml.safe_load_all(built.stdout)}
    assert where[("DaemonSet", "dualtrack-exporter")] == where[("NetworkPolicy", "dualtrack-exporter")] == \
        "dualtrack-node"
    assert {ns for (kind, _), ns in where.items() if kind != "Namespace"} == {"dualtrack", "dualtrack-node"}
    assert [kind for (kind, _), namespace in where.items() if namespace == "dualtrack-node"] == \
        ["Service", "DaemonSet", "ServiceMonitor", "NetworkPolicy"]


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
    from trainer_hook.credentials import ENV_PUSHGATEWAY
    connection = (REPO / "trainer_hook" / "connection.py").read_text()
    for name in env:
        suffix = name.removeprefix(ENV_PUSHGATEWAY)
        assert name.startswith(ENV_PUSHGATEWAY) and (not suffix or f'{{env_prefix}}{suffix}"' in connection), name
    exporter_pod = find("DaemonSet", "dualtrack-exporter")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] != exporter_pod["securityContext"]["runAsUser"]
    hook_volume = next(v for v in pod["volumes"] if v["name"] == "hook")["secret"]
    assert hook_volume["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
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
    from exporter.cli import parse_args
    container = find("DaemonSet", "dualtrack-exporter", with_components(*COMPONENTS))["spec"]["template"]["spec"][
        "containers"][0]
    assert container["command"] == ["dualtrack-exporter"]
    args = parse_args(container["args"], environ={e["name"]: e["value"] for e in container["env"]})
    assert args.collector_podresources and args.web_listen_address == ":9942"
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert Path(args.collector_podresources_socket).parent == Path(mounts["pod-resources"])
    assert Path(args.collector_xid_kernel_log).parent == Path(mounts["kernel-log"])  # the reader's copy


def test_the_remote_write_component_points_labelled_training_workloads_at_the_url(tmp_path):
    """Built by kubectl's kustomize into a training kustomization: the labelled Job gets the URL from the
    generated ConfigMap, an unlabelled Deployment nothing; the URL is one the hook accepts."""
    from trainer_hook.credentials import remote_write
    component = kustomization(KUBE / "components" / "remote-write")
    literal, = component["configMapGenerator"][0]["literals"]
    name, _, url = literal.partition("=")
    assert name == "DUALTRACK_REMOTE_WRITE_URL" and remote_write(url).url == url
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (kustomize) is not installed")
    (tmp_path / "workloads.yaml").write_text(yaml.safe_dump_all([
        {"apiVersion": "batch/v1", "kind": "Job",
         "metadata": {"name": "train", "labels": {"dualtrack.io/training": "true"}},
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
