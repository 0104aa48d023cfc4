"""docker-compose.yml: compose-spec schema, Debian docker-compose's own check, and what neither sees.

No Docker engine is needed: `docker-compose config -q` only parses and cross-checks the file.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from deploy.compose import make_secrets
from tests.stack.containers import engine
from tests.support.deploy import COMPOSE, bind_mounts, compose, mounts, services
from tests.support.paths import REPO

SERVICES = {"exporter", "pushgateway", "prometheus", "alertmanager", "grafana", "janitor"}
GID = "DUALTRACK_SECRETS_GID"
SECRETS = "./deploy/compose/secrets"


@pytest.fixture
def docker_compose(tmp_path):
    """Run Debian's docker-compose on the repo file with exactly `env` (any local .env ignored)."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed (scripts/setup --test installs it)")
    empty = tmp_path / "empty.env"
    empty.touch()
    base = {k: v for k, v in os.environ.items() if k not in (GID, "DUALTRACK_BIND")}

    def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([binary, "--env-file", str(empty), "-f", str(COMPOSE), *args],
                              capture_output=True, text=True, env={**base, **env}, cwd=REPO, timeout=60)
    return run


def test_compose_spec_schema():
    result = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                             "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_docker_compose_config_accepts_the_file(docker_compose):
    result = docker_compose("config", "-q", env={GID: "2300"})
    assert result.returncode == 0, result.stderr


def test_no_password_in_any_containers_environment(docker_compose):
    """Every user of a container (and, through /proc, of its PID namespace) can read its environment:
    passwords are files. Grafana's admin password is GF_SECURITY_ADMIN_PASSWORD__FILE, from make_secrets."""
    rendered = yaml.safe_load(docker_compose("config", env={GID: "2300"}).stdout)["services"]
    for name, service in rendered.items():
        for key, value in (service.get("environment") or {}).items():
            assert not re.search(r"(PASSWORD|TOKEN|SECRET)$", key), (name, key)
            assert not (key.endswith("_FILE")) or value.startswith("/etc/"), (name, key)
        command = " ".join(map(str, (service.get("entrypoint") or []) + (service.get("command") or [])))
        assert "PASSWORD=" not in command and "$(cat" not in command, (name, command)
    grafana = services()["grafana"]
    password_file = grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    assert password_file == f"/etc/dualtrack/secrets/{make_secrets.GRAFANA_ADMIN}.password"
    assert password_file in {target for _, target, _ in mounts(grafana)}
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    janitor = services()["janitor"]
    assert "--pushgateway-password-file=/etc/dualtrack/secrets/hook.password" in janitor["entrypoint"]


def test_the_janitor_and_the_exporter_run_as_different_users():
    """The exporter shares the host's PID namespace: as the janitor's uid it could read the janitor's
    /proc/<pid>/environ and memory. Same image, two users made by the Dockerfile."""
    dockerfile = (REPO / "Dockerfile").read_text()
    exporter_uid = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE).group(1)
    janitor_uid, janitor_gid = services()["janitor"]["user"].split(":")
    # started as uid 0 for /dev/kmsg, the exporter serves as DUALTRACK_EXPORTER_RUN_AS, the image's user
    run_as = services()["exporter"]["environment"]["DUALTRACK_EXPORTER_RUN_AS"]
    image_run_as = re.search(r"DUALTRACK_EXPORTER_RUN_AS=(\S+)", dockerfile).group(1)
    assert run_as == image_run_as == f"{exporter_uid}:{exporter_uid}"
    assert janitor_uid != exporter_uid and janitor_gid != exporter_uid and janitor_uid != "0"
    made = dict(re.findall(r"useradd .*--uid (\d+) .* ([\w-]+)\s*(?:\\|$)", dockerfile, re.MULTILINE))
    assert janitor_uid in made and exporter_uid in made, made
    assert services()["janitor"]["build"] == services()["exporter"]["build"]


def test_every_service_reads_its_secrets_through_the_group_make_secrets_gave_them(docker_compose):
    """Keys and passwords are 0640 with make_secrets.py's --group: a container without that group
    (its own user is nobody, grafana or uid 10001) could not read them and would not start."""
    result = docker_compose("config", "-q", env={})
    assert result.returncode != 0 and GID in result.stderr, result.stderr
    rendered = yaml.safe_load(docker_compose("config", env={GID: "2300"}).stdout)["services"]
    for name, service in services().items():
        if any(source.startswith(SECRETS + "/") for source, _, _ in mounts(service)):
            assert [str(group) for group in rendered[name].get("group_add", [])] == ["2300"], name


def published_ports(rendered: str) -> list[tuple[str, str, str]]:
    """(service, host ip, host port) of each port in `docker-compose config` output (ip:host:container)."""
    return [(name, *port.split(":")[:2]) for name, service in yaml.safe_load(rendered)["services"].items()
            for port in service.get("ports", [])]


def test_ports_bind_to_localhost_unless_opted_out(docker_compose):
    published = published_ports(docker_compose("config", env={GID: "2300"}).stdout)
    assert {name for name, _, _ in published} == SERVICES - {"janitor"}  # the janitor listens on nothing
    assert {ip for _, ip, _ in published} == {"127.0.0.1"}, published
    host_ports = [port for _, _, port in published]
    assert len(host_ports) == len(set(host_ports)), host_ports
    opened = published_ports(docker_compose("config", env={GID: "2300", "DUALTRACK_BIND": "0.0.0.0"}).stdout)
    assert {ip for _, ip, _ in opened} == {"0.0.0.0"}


def test_every_published_port_is_bound_through_the_variable():
    for name, service in services().items():
        for port in service.get("ports", []):
            assert port.startswith("${DUALTRACK_BIND:-127.0.0.1}:"), (name, port)


DIGEST = r"@sha256:[0-9a-f]{64}"
BY_TAG_ONLY = {"grafana"}  # no digest recorded yet (docs/security.md says so)


def test_images_are_pinned_by_digest_and_listed_in_the_docs():
    """Each image by version tag and digest (the base image too); docs/security.md lists every digest;
    the container test runs stand-ins under the same names by tag (no registry: no upstream digest)."""
    security = (REPO / "docs" / "security.md").read_text()
    override = yaml.safe_load(
        (REPO / "tests" / "stack" / "containers" / "compose.override.yml").read_text())["services"]
    pinned = {name: service["image"] for name, service in services().items() if "image" in service}
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE).group(1)
    for name, image in [*pinned.items(), ("Dockerfile", base)]:
        tagged = re.sub(DIGEST + "$", "", image)
        assert re.fullmatch(r"[\w./-]+:v?\d+(\.\d+)*(-slim)?", tagged), f"{name}: {image} has no version tag"
        if name in BY_TAG_ONLY:
            assert tagged == image and f"`{image}`" in security, name
            continue
        assert re.fullmatch(r"[\w./-]+:[\w.-]+" + DIGEST, image), f"{name}: {image} is not pinned by digest"
        assert f"`{image}`" in security, f"{name}: docs/security.md does not list {image}"
        stand_in = (override[name]["image"] if name in override
                    else override["exporter"]["build"]["args"]["PYTHON_IMAGE"])
        assert stand_in == tagged, (name, stand_in)
        assert f"docker.io/{'library/' if '/' not in tagged else ''}{tagged}" in engine.IMAGES, name
    assert set(override) - {"exporter", "janitor", "training"} == set(pinned) - BY_TAG_ONLY - {"grafana"}
    assert services()["grafana"]["image"].startswith("grafana/grafana:11.")


def installed_requirements(requirement: str, seen: dict[str, str]) -> dict[str, str]:
    """Every distribution `requirement` pulls in (as installed here), by canonical name, with its floor."""
    parsed = Requirement(requirement)
    name = canonicalize_name(parsed.name)
    if name not in seen:
        seen[name] = str(parsed.specifier)
        for sub in importlib.metadata.distribution(parsed.name).requires or []:
            wanted = Requirement(sub)
            if wanted.marker is None or any(wanted.marker.evaluate({"extra": e}) for e in parsed.extras or {""}):
                installed_requirements(sub, seen)
    return seen


def test_the_images_python_packages_are_all_pinned_by_the_constraints_file():
    """The Dockerfile installs ".[kubernetes]" with -c deploy/constraints.txt: every package that needs
    is pinned there (==), at a version that meets pyproject.toml's floor. The container test builds it."""
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r'^COPY deploy/constraints.txt \./constraints.txt$', dockerfile, re.MULTILINE)
    assert re.search(r'^RUN pip install -c constraints.txt "\.\[kubernetes\]"', dockerfile, re.MULTILINE)
    pins = {}
    for line in (REPO / "deploy" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            assert len(requirement.specifier) == 1 and next(iter(requirement.specifier)).operator == "==", line
            pins[canonicalize_name(requirement.name)] = next(iter(requirement.specifier)).version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed: dict[str, str] = {}
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["kubernetes"]]:
        installed_requirements(requirement, needed)
    assert set(needed) <= set(pins), f"not pinned: {sorted(set(needed) - set(pins))}"
    for name, floor in needed.items():
        assert SpecifierSet(floor).contains(pins[name], prereleases=True), (name, floor, pins[name])


def test_env_example_suggests_a_group_of_its_own_for_the_secrets():
    """Not the user's primary group (often "users", shared by every local account): a dedicated one."""
    example = (REPO / ".env.example").read_text()
    for text in (example, (REPO / "README.md").read_text(), (REPO / "docs" / "security.md").read_text()):
        assert "id -g" not in text
        assert "groupadd --system dualtrack-secrets" in text and "--group dualtrack-secrets" in text
    assert 'DUALTRACK_SECRETS_GID=$(getent group dualtrack-secrets | cut -d: -f3)' in example


def test_every_bind_mount_exists_in_the_repo_and_is_read_only():
    made = set(make_secrets.FILES)
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
    # the kernel log's XIDs: /dev/kmsg read-only and CAP_SYSLOG, which Docker gives to uid 0 only; with
    # CAP_SETUID and CAP_SETGID to serve as DUALTRACK_EXPORTER_RUN_AS with none of them once it is open
    assert exporter["devices"] == ["/dev/kmsg:/dev/kmsg:r"] and exporter["cap_add"] == ["SYSLOG", "SETUID", "SETGID"]
    assert exporter["user"] == "0:0" and exporter["environment"]["DUALTRACK_EXPORTER_RUN_AS"] == "10001:10001"


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
        assert Path(pattern).is_relative_to(rules_target), pattern
        assert list((REPO / "rules").glob(str(Path(pattern).relative_to(rules_target)))), \
            f"{pattern} matches no file in rules/"
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
