"""docker-compose.yml: compose-spec schema, Debian docker-compose's own check, and what neither sees.

No Docker engine is needed: `docker-compose config -q` only parses and cross-checks the file.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from deploy.compose import make_secrets
from stack.processes import REPO

COMPOSE = REPO / "docker-compose.yml"
SERVICES = {"exporter", "pushgateway", "prometheus", "alertmanager", "grafana", "janitor"}
PASSWORD = "GRAFANA_ADMIN_PASSWORD"
GID = "DUALTRACK_SECRETS_GID"
SECRETS = "./deploy/compose/secrets"


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


@pytest.fixture
def docker_compose(tmp_path):
    """Run Debian's docker-compose on the repo file with exactly `env` (any local .env ignored)."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed (scripts/setup --test installs it)")
    empty = tmp_path / "empty.env"
    empty.touch()
    base = {k: v for k, v in os.environ.items() if k not in (PASSWORD, GID, "DUALTRACK_BIND")}

    def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([binary, "--env-file", str(empty), "-f", str(COMPOSE), *args],
                              capture_output=True, text=True, env={**base, **env}, cwd=REPO, timeout=60)
    return run


def test_compose_spec_schema():
    result = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                             "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_docker_compose_config_accepts_the_file(docker_compose):
    result = docker_compose("config", "-q", env={PASSWORD: "not-a-real-password", GID: "2300"})
    assert result.returncode == 0, result.stderr


def test_grafana_password_has_no_default(docker_compose):
    result = docker_compose("config", "-q", env={GID: "2300"})
    assert result.returncode != 0
    assert PASSWORD in result.stderr
    password = services()["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${" + PASSWORD + ":?"), password
    assert services()["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_every_service_reads_its_secrets_through_the_group_make_secrets_gave_them(docker_compose):
    """Keys and passwords are 0640 with make_secrets.py's --group: a container without that group
    (its own user is nobody, grafana or uid 10001) could not read them and would not start."""
    result = docker_compose("config", "-q", env={PASSWORD: "x"})
    assert result.returncode != 0 and GID in result.stderr, result.stderr
    rendered = yaml.safe_load(docker_compose("config", env={PASSWORD: "x", GID: "2300"}).stdout)["services"]
    for name, service in services().items():
        if any(source.startswith(SECRETS + "/") for source, _, _ in mounts(service)):
            assert [str(group) for group in rendered[name].get("group_add", [])] == ["2300"], name


def published_ports(rendered: str) -> list[tuple[str, str, str]]:
    """(service, host ip, host port) of each port in `docker-compose config` output (ip:host:container)."""
    return [(name, *port.split(":")[:2]) for name, service in yaml.safe_load(rendered)["services"].items()
            for port in service.get("ports", [])]


def test_ports_bind_to_localhost_unless_opted_out(docker_compose):
    published = published_ports(docker_compose("config", env={PASSWORD: "x", GID: "2300"}).stdout)
    assert {name for name, _, _ in published} == SERVICES - {"janitor"}  # the janitor listens on nothing
    assert {ip for _, ip, _ in published} == {"127.0.0.1"}, published
    host_ports = [port for _, _, port in published]
    assert len(host_ports) == len(set(host_ports)), host_ports
    opened = published_ports(docker_compose("config", env={PASSWORD: "x", GID: "2300",
                                                           "DUALTRACK_BIND": "0.0.0.0"}).stdout)
    assert {ip for _, ip, _ in opened} == {"0.0.0.0"}


def test_every_published_port_is_bound_through_the_variable():
    for name, service in services().items():
        for port in service.get("ports", []):
            assert port.startswith("${DUALTRACK_BIND:-127.0.0.1}:"), (name, port)


def test_images_are_pinned():
    for name, service in services().items():
        if "build" in service:
            continue
        image = service["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name}: {image} is not pinned"
    assert services()["grafana"]["image"].startswith("grafana/grafana:11.")


def test_every_bind_mount_exists_in_the_repo_and_is_read_only():
    made = {f"{user}.password" for users in make_secrets.USERS.values() for user in users}
    made |= {f"{service}-web.yml" for service in make_secrets.SERVICES} | {"ca.crt", "tls.crt", "tls.key"}
    found = [(name, source, read_only) for name, service in services().items()
             for source, _, read_only in mounts(service) if source.startswith(".")]
    assert len(found) >= 5
    for name, source, read_only in found:
        if source.startswith(SECRETS + "/"):  # made by make_secrets.py, never committed
            assert source[len(SECRETS) + 1:] in made, f"{name} mounts {source}, which make_secrets.py does not make"
        else:
            assert (REPO / source).exists(), f"{name} mounts {source}, which is not in the repo"
        assert read_only, f"{name}: {source} is writable"


def test_services_mount_only_the_secret_files_they_use():
    """A daemon that is broken into reads only its own secrets: no service mounts the whole folder, and
    the private key and the admin password stay out of the services that do not use them."""
    for name, service in services().items():
        secrets = {source[len(SECRETS) + 1:] for source, _ in bind_mounts(service) if source.startswith(SECRETS)}
        assert "" not in secrets and SECRETS not in {source.rstrip("/") for source, _ in bind_mounts(service)}, \
            f"{name} mounts the whole secrets folder"
        assert "admin.password" not in secrets and "ca.key" not in secrets, (name, secrets)
        if name in ("grafana", "janitor"):
            assert "tls.key" not in secrets, (name, secrets)


def test_no_health_check_puts_a_password_on_a_command_line():
    """Health checks run as processes every host user can list (`ps`): no password in their argv."""
    for name, service in services().items():
        test = " ".join(service.get("healthcheck", {}).get("test", []))
        assert "password" not in test and "$(cat" not in test and "$$(cat" not in test, (name, test)
        assert "@127.0.0.1" not in test, (name, test)  # user:password@host
    healthcheck = (REPO / "deploy" / "healthcheck.py").read_text()
    assert "read_text()" in healthcheck and "Authorization" in healthcheck  # the exporter's reads its file


def test_depends_on_targets_exist_and_are_healthchecked():
    for name, service in services().items():
        for target, condition in (service.get("depends_on") or {}).items():
            assert target in services(), f"{name} depends on unknown {target}"
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services()[target] or "build" in services()[target], target


def test_services_have_healthchecks_and_named_volumes():
    assert set(services()) == SERVICES
    for name, service in services().items():
        if "build" in service:  # our own image brings its HEALTHCHECK
            dockerfile = (REPO / service["build"] / "Dockerfile").read_text()
            assert re.search(r"^HEALTHCHECK .*\n?.*CMD .*/-/ready", dockerfile, re.MULTILINE), name
        else:
            assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    named = {source for service in services().values() for source, _, _ in mounts(service)
             if not source.startswith((".", "/"))}
    assert named == set(compose()["volumes"]) and {"prometheus-data", "grafana-data"} <= named


def test_exporter_gets_gpus_host_pids_and_no_privileges():
    exporter = services()["exporter"]
    assert exporter["build"] == "." and (REPO / "Dockerfile").exists()
    devices = exporter["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert exporter["pid"] == "host"
    assert exporter["read_only"] is True and exporter["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in exporter["security_opt"]
    assert "privileged" not in exporter
    # the kernel log's XIDs: /dev/kmsg read-only and CAP_SYSLOG, which Docker gives to uid 0 only
    assert exporter["devices"] == ["/dev/kmsg:/dev/kmsg:r"] and exporter["cap_add"] == ["SYSLOG"]
    assert exporter["user"] == "0:0"


def test_keys_debian_docker_compose_rejects_are_absent():
    assert "name" not in compose() and "version" not in compose()
    assert all("gpus" not in service for service in services().values())


def test_prometheus_paths_match_prometheus_yml():
    prometheus = services()["prometheus"]
    mounts = dict(bind_mounts(prometheus))
    config_file = next(arg.split("=", 1)[1] for arg in prometheus["command"] if arg.startswith("--config.file="))
    assert mounts["./prometheus.yml"] == config_file
    config = yaml.safe_load((REPO / "prometheus.yml").read_text())
    rules_target = mounts["./rules"]
    for pattern in config["rule_files"]:
        assert Path(pattern).parent == Path(rules_target), pattern
        assert list((REPO / "rules").glob(Path(pattern).name)), f"{pattern} matches no file in rules/"
    targets = {t for job in config["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]}
    assert {"exporter:9942", "pushgateway:9091"} <= targets
    for target in targets - {"localhost:9090"}:
        host, port = target.split(":")
        assert host in services() and any(p.endswith(f":{port}") for p in services()[host]["ports"]), target


@pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool not installed (scripts/setup)")
def test_alertmanager_entrypoint_renders_a_valid_config_with_the_webhook(tmp_path):
    """Run the service's entrypoint as the container would (paths mapped to the repo and tmp_path)."""
    alertmanager = services()["alertmanager"]
    mapped = {target: REPO / source for source, target in bind_mounts(alertmanager)}
    data = next(target for source, target, _ in mounts(alertmanager) if source == "alertmanager-data")

    def local(path: str) -> str:
        for target, source in mapped.items():
            if path.startswith(target + "/"):
                return str(source / path[len(target) + 1:])
        return str(tmp_path / path[len(data) + 1:]) if path.startswith(data + "/") else path

    shell, script, template, output, binary = alertmanager["entrypoint"]
    config_file = next(a.split("=", 1)[1] for a in alertmanager["command"] if a.startswith("--config.file="))
    assert output == config_file and binary == "/bin/alertmanager"
    url = "http://127.0.0.1:9/dualtrack-test-hook"
    user_env = {"DUALTRACK_WEBHOOK_URL": url}  # as a user's .env would set it; the critical URL unset
    env = {"PATH": os.environ["PATH"],
           **{key: re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: user_env.get(m.group(1), m.group(2)), value)
              for key, value in alertmanager["environment"].items()}}
    subprocess.run([shell, local(script), local(template), local(output)], env=env, check=True)
    rendered = Path(local(output)).read_text()
    assert url in rendered and "dualtrack-webhook.invalid" not in rendered
    check = subprocess.run(["amtool", "check-config", local(output)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_env_example_documents_every_variable():
    variables = set(re.findall(r"\$\{(\w+)", COMPOSE.read_text()))
    documented = set(re.findall(r"^#?\s*(\w+)=", (REPO / ".env.example").read_text(), re.MULTILINE))
    assert variables <= documented, variables - documented
