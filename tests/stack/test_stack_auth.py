"""The stack across hosts: every daemon with the web-config make_secrets.py writes (TLS + bcrypt basic auth).

Real Pushgateway, Prometheus, Alertmanager and exporter on loopback, each reading its generated
web-config; Prometheus scrapes and alerts with the generated client password; the compose health
checks and the exporter image's health check run as they would in the containers.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from dualtrack.prometheus import Prometheus
from stack import processes
from tests.support.paths import REPO
from trainer_hook.connection import Endpoint

sys.path.insert(0, str(REPO / "deploy" / "compose"))
import make_secrets

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")]
SECRETS_MOUNT = "/etc/dualtrack/secrets"


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("secrets")
    make_secrets.make_secrets(directory, hosts=["gpu-box.example.org"])
    return directory


def password(secrets_dir: Path, user: str) -> str:
    return (secrets_dir / f"{user}.password").read_text().strip()


@pytest.fixture(scope="module")
def stack(secrets_dir, tmp_path_factory):
    """Pushgateway, Alertmanager, exporter and Prometheus, all TLS + basic auth, Prometheus scraping them."""
    workdir = tmp_path_factory.mktemp("stack")
    admin = ("admin", password(secrets_dir, "admin"))
    started = []

    def start(service: processes.Service) -> processes.Service:
        started.append(service)
        return service.start()

    try:
        pushgateway = start(processes.pushgateway(workdir, web_config=secrets_dir / "pushgateway-web.yml", auth=admin))
        alertmanager = start(processes.alertmanager(
            workdir, processes.render_alertmanager_config(workdir), web_config=secrets_dir / "alertmanager-web.yml",
            auth=admin))
        exporter = processes.exporter(workdir, ["--simulate=healthy", "--simulate.gpus=1"], scheme="https",
                                      env={"DUALTRACK_EXPORTER_WEB_CONFIG_FILE": str(secrets_dir / "exporter-web.yml")})
        exporter.auth = ("healthcheck", password(secrets_dir, "healthcheck"))
        start(exporter)
        port = processes.free_port()
        client = {"scheme": "https", "tls_config": {"ca_file": str(secrets_dir / "ca.crt")},
                  "basic_auth": {"username": "prometheus", "password_file": str(secrets_dir / "prometheus.password")}}
        config = processes.render_prometheus_config(
            workdir, {processes.PUSHGATEWAY_JOB: [pushgateway.address], processes.EXPORTER_JOB: [exporter.address],
                      "prometheus": [f"127.0.0.1:{port}"]},
            scrape_interval="1s", alertmanagers=[alertmanager.address], client=client)
        prometheus = start(processes.prometheus(workdir, config, port=port,
                                                web_config=secrets_dir / "prometheus-web.yml", auth=admin))
        yield {"pushgateway": pushgateway, "alertmanager": alertmanager, "exporter": exporter,
               "prometheus": prometheus}
    finally:
        for service in reversed(started):
            service.stop()


def plain_http_status(service: processes.Service) -> int | None:
    """The status of a plain-HTTP request (Go's TLS servers answer 400, ours closes the connection: None)."""
    try:
        return requests.get(f"http://{service.address}/-/healthy", timeout=5).status_code
    except requests.ConnectionError:
        return None


def test_wrong_credentials_or_plain_http_are_refused_everywhere(stack, secrets_dir):
    ca = str(secrets_dir / "ca.crt")
    for name, service in stack.items():
        assert requests.get(service.url + "/-/healthy", verify=ca, timeout=5).status_code == 401, name
        assert requests.get(service.url + "/-/healthy", verify=ca, timeout=5,
                            auth=("admin", "not-the-password")).status_code == 401, name
        assert plain_http_status(service) != 200, name
    assert requests.get(stack["pushgateway"].url + "/-/ready", verify=ca, timeout=5,
                        auth=("hook", password(secrets_dir, "hook"))).status_code == 200


def test_the_healthcheck_user_is_let_in_by_the_exporter_only(stack, secrets_dir):
    """The exporter container holds healthcheck.password: no other daemon may accept it (push, query, quit)."""
    ca, healthcheck = str(secrets_dir / "ca.crt"), ("healthcheck", password(secrets_dir, "healthcheck"))
    assert requests.get(stack["exporter"].url + "/-/ready", verify=ca, timeout=5, auth=healthcheck).status_code == 200
    for name in ("pushgateway", "prometheus", "alertmanager"):
        url = stack[name].url
        assert requests.get(url + "/-/ready", verify=ca, timeout=5, auth=healthcheck).status_code == 401, name
    pushed = requests.put(stack["pushgateway"].url + "/metrics/job/intruder", data="x 1\n", verify=ca, timeout=5,
                          auth=healthcheck)
    assert pushed.status_code == 401
    assert requests.post(stack["prometheus"].url + "/-/quit", verify=ca, timeout=5, auth=healthcheck).status_code == 401
    assert stack["prometheus"].running()


def test_the_hook_pushes_only_with_the_right_password_and_prometheus_scrapes_it_all(stack, secrets_dir, tmp_path):
    from trainer_hook import TrainingMonitor
    pushgateway, prometheus = stack["pushgateway"], stack["prometheus"]
    ca = str(secrets_dir / "ca.crt")
    monitors = {}
    for run, secret in (("refused", "wrong-password"), ("accepted", password(secrets_dir, "hook"))):
        with TrainingMonitor(job="auth", run=run, pushgateway=pushgateway.url, basic_auth=("hook", secret),
                             ca_file=ca, push_interval=60, push_timeout=5,
                             record_path=tmp_path / f"{run}.jsonl") as monitor:
            monitor.log({"loss": 0.25}, step=1)
        monitors[run] = monitor
    assert monitors["refused"]._pusher.failures >= 1
    assert monitors["accepted"]._pusher.failures == 0

    grafana = ("grafana", password(secrets_dir, "grafana"))  # what the provisioned datasource logs in as

    client = Prometheus(Endpoint(prometheus.url, basic_auth=grafana, ca_file=str(ca)), timeout=5)

    def series(expr: str) -> list[dict]:
        return client.query(expr)

    runs = processes.wait_until(lambda: series('training_loss{job="auth"}'), 30, interval=0.25,
                                what="training_loss scraped over TLS with auth")
    assert [r["metric"]["run"] for r in runs] == ["accepted"]
    up = processes.wait_until(lambda: (result := series("up == 1")) and len(result) == 3 and result, 30,
                              interval=0.25, what="every target up")
    assert {r["metric"]["job"] for r in up} == {"pushgateway", "dualtrack-exporter", "prometheus"}
    alertmanagers = requests.get(prometheus.url + "/api/v1/alertmanagers", auth=grafana, verify=ca, timeout=5).json()
    assert [a["url"] for a in alertmanagers["data"]["activeAlertmanagers"]] == \
        [f"https://{stack['alertmanager'].address}/api/v2/alerts"]


def test_alertmanager_takes_alerts_with_prometheus_credentials_only(stack, secrets_dir):
    url, ca = stack["alertmanager"].url + "/api/v2/alerts", str(secrets_dir / "ca.crt")
    alert = [{"labels": {"alertname": "AuthCheck", "severity": "warning"}}]
    assert requests.post(url, json=alert, verify=ca, timeout=5, auth=("hook", password(secrets_dir, "hook"))
                         ).status_code == 401
    assert requests.post(url, json=alert, verify=ca, timeout=5,
                         auth=("prometheus", password(secrets_dir, "prometheus"))).status_code == 200


def compose_healthcheck(service: str, port: int) -> str:
    """The compose service's health-check command, as the container's shell would run it here."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    kind, command = compose["services"][service]["healthcheck"]["test"]
    assert kind == "CMD-SHELL"
    default_port = re.search(r"127\.0\.0\.1:(\d+)/", command).group(1)
    return command.replace("$$", "$").replace(f"127.0.0.1:{default_port}/", f"127.0.0.1:{port}/")


@pytest.mark.skipif(shutil.which("busybox") is None, reason="busybox not installed (scripts/setup --test)")
@pytest.mark.parametrize("service", ["pushgateway", "prometheus", "alertmanager"])
def test_compose_health_checks_pass_under_tls_and_auth_and_fail_when_nothing_answers(stack, tmp_path, service):
    """The checks carry no password: they pass when the daemon answers TLS and refuses a request without
    credentials (401). Run with busybox's wget, as in the upstream images."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "wget").symlink_to(shutil.which("busybox"))
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"}

    def check(port: int) -> int:
        return subprocess.run(["sh", "-c", compose_healthcheck(service, port)], env=env, timeout=20,
                              capture_output=True).returncode
    assert check(stack[service].port) == 0
    assert check(processes.free_port()) != 0


def test_exporter_image_health_check_follows_its_web_config(stack, secrets_dir, tmp_path):
    exporter = stack["exporter"]
    env = {**os.environ, "DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS": exporter.address,
           "DUALTRACK_EXPORTER_WEB_CONFIG_FILE": str(secrets_dir / "exporter-web.yml"),
           "DUALTRACK_HEALTHCHECK_PASSWORD_FILE": str(secrets_dir / "healthcheck.password")}
    check = [sys.executable, str(REPO / "deploy" / "healthcheck.py"), "/-/ready"]
    assert subprocess.run(check, env=env, timeout=20).returncode == 0
    wrong = tmp_path / "wrong.password"
    wrong.write_text("nope\n")
    result = subprocess.run(check, env={**env, "DUALTRACK_HEALTHCHECK_PASSWORD_FILE": str(wrong)}, timeout=20,
                            capture_output=True, text=True)
    assert result.returncode == 1 and "401" in result.stderr and len(result.stderr.splitlines()) == 1


def test_make_secrets_refuses_to_overwrite_and_leaves_no_password_in_web_configs(secrets_dir):
    assert make_secrets.main(["--dir", str(secrets_dir)]) == 2
    for service in make_secrets.USERS:
        config = yaml.safe_load((secrets_dir / f"{service}-web.yml").read_text())
        assert set(config) == {"tls_server_config", "basic_auth_users"}
        assert all(h.startswith("$2b$") for h in config["basic_auth_users"].values())
        text = (secrets_dir / f"{service}-web.yml").read_text()
        assert not any(password(secrets_dir, user) in text for user in config["basic_auth_users"])
        check = subprocess.run(["promtool", "check", "web-config", str(secrets_dir / f"{service}-web.yml")],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    san = subprocess.run(["openssl", "x509", "-in", str(secrets_dir / "tls.crt"), "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True).stdout
    for name in ("DNS:pushgateway", "DNS:prometheus", "DNS:alertmanager", "DNS:exporter", "IP Address:127.0.0.1",
                 "DNS:gpu-box.example.org"):
        assert name in san


def test_compose_prometheus_and_grafana_use_only_files_and_users_make_secrets_provides(secrets_dir):
    """Every secrets path the stack's files name is one make_secrets writes, mounted where it is read."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    sources = {"docker-compose.yml": (REPO / "docker-compose.yml").read_text(),
               "prometheus.yml": (REPO / "prometheus.yml").read_text(),
               "datasources": (REPO / "grafana/provisioning/datasources/dualtrack.yml").read_text()}
    for name, text in sources.items():
        for file in re.findall(re.escape(SECRETS_MOUNT) + r"/([\w.-]+)", text):
            assert (secrets_dir / file).is_file(), f"{name} reads {file}, which make_secrets does not write"
    # Each service mounts, file by file, what it reads: its compose settings, prometheus.yml for
    # Prometheus, the datasources for Grafana, and the certificate and key its web-config names.
    reads = {service: set(re.findall(re.escape(SECRETS_MOUNT) + r"/([\w.-]+)", str(compose[service])))
             for service in compose}
    reads["prometheus"] |= set(re.findall(re.escape(SECRETS_MOUNT) + r"/([\w.-]+)", sources["prometheus.yml"]))
    reads["grafana"] |= set(re.findall(re.escape(SECRETS_MOUNT) + r"/([\w.-]+)", sources["datasources"]))
    for service in ("exporter", "pushgateway", "prometheus", "alertmanager"):
        assert f"{service}-web.yml" in reads[service], service
        reads[service] |= {"tls.crt", "tls.key"}
    for service, files in reads.items():
        mounted = {volume["target"] for volume in compose[service].get("volumes", []) if isinstance(volume, dict)}
        assert {f"{SECRETS_MOUNT}/{file}" for file in files} <= mounted, (service, files, mounted)

    config = yaml.safe_load(sources["prometheus.yml"])
    targets = {job["job_name"]: job for job in config["scrape_configs"]}
    services = {"dualtrack-exporter": "exporter", "pushgateway": "pushgateway", "prometheus": "prometheus"}
    endpoints = [(services[name], job) for name, job in targets.items()]
    endpoints += [("alertmanager", am) for am in config["alerting"]["alertmanagers"]]
    for service, endpoint in endpoints:
        assert endpoint["scheme"] == "https" and endpoint["tls_config"]["ca_file"].endswith("/ca.crt")
        user = endpoint["basic_auth"]["username"]
        assert user in make_secrets.USERS[service], (service, user)
        assert endpoint["basic_auth"]["password_file"].endswith(f"/{user}.password")
    datasources = yaml.safe_load(sources["datasources"])["datasources"]
    for datasource in datasources:
        assert datasource["url"].startswith("https://") and datasource["basicAuth"] is True
        service = datasource["url"].split("//")[1].split(":")[0]
        assert datasource["basicAuthUser"] in make_secrets.USERS[service]
        assert datasource["secureJsonData"]["basicAuthPassword"].endswith(f"/{datasource['basicAuthUser']}.password}}")
