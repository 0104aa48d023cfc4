"""Notification channels (alertmanager/channels/, alertmanager/templates/dualtrack.tmpl): each one
switched on passes amtool, the templates render, and a real Alertmanager delivers a real alert
(a NaN loss from the hook, through Prometheus and the repo's rules) to a loopback webhook, a Slack and
a PagerDuty sink (their API URLs pointed at loopback) and an SMTP sink, each message carrying the run,
the likely cause and both links."""
from __future__ import annotations

import email
import email.policy
import re
import subprocess
from pathlib import Path

import pytest
import requests
import yaml

from stack import processes
from stack.processes import WebhookReceiver, wait_until
from tests.support.alerting import NonFiniteRun, start_pipeline
from tests.support.paths import REPO

CHANNELS = REPO / "alertmanager" / "channels"
TEMPLATES = REPO / "alertmanager" / "templates"
SECRET_FILES = {"slack": "slack-api-url", "pagerduty": "pagerduty-routing-key", "email": "smtp-password",
                "msteams": "msteams-webhook-url"}
#: Channels Debian's Alertmanager 0.25 takes; msteams needs 0.27 (webhook_url_file).
CHECKED_BY_AMTOOL_025 = ("slack", "pagerduty", "email")
SMTP_USER, SMTP_PASSWORD = "alertmanager", "smtp-secret-4b1d"


def render(tmp_path: Path, channels: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    secrets = tmp_path / "secrets"
    secrets.mkdir(exist_ok=True)
    for name in SECRET_FILES.values():
        (secrets / name).write_text("http://127.0.0.1:9/unused\n")
    out = tmp_path / "alertmanager.yml"
    result = subprocess.run(["sh", str(processes.ALERTMANAGER_RENDER), str(processes.ALERTMANAGER_YML), str(out)],
                            capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "DUALTRACK_CHANNELS": channels,
                                 "DUALTRACK_ALERTMANAGER_SECRETS": str(secrets),
                                 "DUALTRACK_EMAIL_TO": "oncall@example.org",
                                 "DUALTRACK_EMAIL_FROM": "dualtrack@example.org",
                                 "DUALTRACK_SMTP_SMARTHOST": "127.0.0.1:25", **env})
    return result, out


def amtool_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["amtool", "check-config", str(path)], capture_output=True, text=True, timeout=30)


def amtool_version() -> tuple[int, ...]:
    out = subprocess.run(["amtool", "--version"], capture_output=True, text=True, timeout=30)
    found = re.search(r"version (\d+)\.(\d+)", out.stdout + out.stderr)
    return tuple(int(part) for part in found.groups()) if found else (0,)


@pytest.mark.parametrize("channels", [*CHECKED_BY_AMTOOL_025, " ".join(CHECKED_BY_AMTOOL_025)])
def test_each_channel_switched_on_passes_amtool_with_its_secret_from_a_file(tmp_path, channels):
    result, path = render(tmp_path, channels.replace(" ", ","))
    assert result.returncode == 0, result.stderr
    check = amtool_check(path)
    assert check.returncode == 0, check.stdout + check.stderr
    config = yaml.safe_load(path.read_text())
    assert config["templates"] == [f"{TEMPLATES}/*.tmpl"]
    for receiver in config["receivers"]:
        assert "webhook_configs" not in receiver, "channels without a webhook URL leave the webhook out"
        for channel in channels.split():
            key = f"{channel}_configs"
            assert len(receiver[key]) == 1, receiver
            secret = next(value for field, value in receiver[key][0].items() if field.endswith("_file"))
            assert secret == str(tmp_path / "secrets" / SECRET_FILES[channel])
    assert "@" not in re.sub(r"[\w.-]+@example\.org", "", path.read_text()), "a placeholder was left"


def test_teams_is_gated_on_alertmanager_0_27(tmp_path):
    """msteams_configs with webhook_url_file exist from Alertmanager 0.27 (compose runs 0.27.0): the
    channel renders like the others; amtool checks it where amtool is 0.27 or newer, and 0.25 refuses it."""
    result, path = render(tmp_path, "msteams")
    assert result.returncode == 0, result.stderr
    teams = [receiver["msteams_configs"][0] for receiver in yaml.safe_load(path.read_text())["receivers"]]
    assert teams[0]["webhook_url_file"] == str(tmp_path / "secrets" / "msteams-webhook-url")
    assert teams[0]["text"] == '{{ template "dualtrack.text" . }}'
    assert "prom/alertmanager:v0.27" in (REPO / "docker-compose.yml").read_text()
    check = amtool_check(path)
    if amtool_version() >= (0, 27):
        assert check.returncode == 0, check.stdout + check.stderr
    else:
        assert check.returncode != 0 and "msteams_configs" in check.stdout + check.stderr


def test_an_unknown_channel_is_one_line_and_exit_2(tmp_path):
    result, _ = render(tmp_path, "slack,pager")
    assert result.returncode == 2
    assert result.stderr == ("render-config.sh: DUALTRACK_CHANNELS: unknown channel 'pager' "
                             "(known: slack pagerduty email msteams)\n")


def test_channels_and_a_webhook_url_send_to_both(tmp_path):
    result, path = render(tmp_path, "slack", DUALTRACK_WEBHOOK_URL="http://127.0.0.1:9/hook")
    assert result.returncode == 0, result.stderr
    for receiver in yaml.safe_load(path.read_text())["receivers"]:
        assert receiver["webhook_configs"][0]["url"] == "http://127.0.0.1:9/hook" and receiver["slack_configs"]


def test_the_templates_render_with_amtool():
    result = subprocess.run(["amtool", "template", "render", f"--template.glob={TEMPLATES}/*.tmpl",
                             '--template.text={{ template "dualtrack.title" . }}\n{{ template "dualtrack.text" . }}'],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "RESOLVED" in result.stdout


class SmtpSink:
    """aiosmtpd on loopback that requires AUTH (so Alertmanager must read the password file; no TLS on
    loopback, which Alertmanager allows with require_tls false) and keeps each message it accepts."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import AuthResult

        self.messages: list[email.message.EmailMessage] = []
        self.logins: list[tuple[bytes, bytes]] = []
        sink = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):  # aiosmtpd's naming
                sink.messages.append(email.message_from_bytes(envelope.original_content, policy=email.policy.default))
                return "250 OK"

        def authenticate(server, session, envelope, mechanism, auth_data):
            sink.logins.append((auth_data.login, auth_data.password))
            expected = (SMTP_USER.encode(), SMTP_PASSWORD.encode())
            return AuthResult(success=(auth_data.login, auth_data.password) == expected)

        self.port = processes.free_port()
        # PLAIN only: aiosmtpd's LOGIN challenge ("User Name") is not the "Username:" Alertmanager expects.
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port, authenticator=authenticate,
                                     auth_required=True, auth_require_tls=False, auth_exclude_mechanism=["LOGIN"])

    def bodies(self) -> list[str]:
        return [message.get_body(("plain",)).get_content() for message in self.messages]


@pytest.fixture
def smtp_sink():
    pytest.importorskip("aiosmtpd", reason="the test extra installs aiosmtpd")
    sink = SmtpSink()
    sink.controller.start()
    yield sink
    sink.controller.stop()


@pytest.fixture
def http_sinks():
    sinks = {name: WebhookReceiver().start() for name in ("slack", "pagerduty")}
    yield sinks
    for sink in sinks.values():
        sink.stop()


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
def test_a_nan_loss_reaches_the_webhook_slack_pagerduty_and_email_with_run_cause_and_links(
        tmp_path, start_service, webhook_receiver, http_sinks, smtp_sink, monkeypatch):
    monkeypatch.setenv("DUALTRACK_GRAFANA_URL", "https://grafana.example.org")  # the dashboard links' base
    secrets = tmp_path / "notify"
    secrets.mkdir(mode=0o700)
    for name, value in {"slack-api-url": http_sinks["slack"].url, "pagerduty-routing-key": "routing-key-7f3a",
                        "smtp-password": SMTP_PASSWORD}.items():
        (secrets / name).write_text(value)  # no newline: Alertmanager 0.25 sends a password file as it is
        (secrets / name).chmod(0o600)
    pipeline = start_pipeline(tmp_path, start_service, webhook_receiver, alertmanager_env={
        "DUALTRACK_CHANNELS": "slack pagerduty email", "DUALTRACK_ALERTMANAGER_SECRETS": str(secrets),
        "DUALTRACK_PAGERDUTY_URL": http_sinks["pagerduty"].url, "DUALTRACK_EMAIL_TO": "oncall@example.org",
        "DUALTRACK_EMAIL_FROM": "dualtrack@example.org", "DUALTRACK_SMTP_SMARTHOST": f"127.0.0.1:{smtp_sink.port}",
        "DUALTRACK_SMTP_USERNAME": SMTP_USER, "DUALTRACK_SMTP_REQUIRE_TLS": "false"})
    run = NonFiniteRun.start(pipeline, tmp_path / "record.jsonl")
    with run.monitor:
        run.train(5)
        run.diverge(healthy_steps=0)
        run.train(3)
        _, alert = webhook_receiver.wait_for_alert("TrainingLossNonFinite", run=run.run, timeout=90)
        slack = wait_until(lambda: http_sinks["slack"].notifications(), 60, what="the Slack message")[0]
        pagerduty = wait_until(lambda: http_sinks["pagerduty"].notifications(), 60, what="the PagerDuty event")[0]
        mail = wait_until(smtp_sink.bodies, 60, what="the email")[0]

    print(f"the email, as sent:\nSubject: {smtp_sink.messages[0]['Subject']}\n{mail}")
    annotations = alert["annotations"]
    cause = " ".join(annotations["infra_cause"].split())
    assert cause.startswith("none: the run reports no GPU") and run.run in cause
    attachment = slack["attachments"][0]
    assert attachment["title"].startswith(f"[FIRING:1] TrainingLossNonFinite run {run.run} (job alerting-test)")
    assert pagerduty["routing_key"] == "routing-key-7f3a" and pagerduty["payload"]["severity"] == "critical"
    assert smtp_sink.logins == [(SMTP_USER.encode(), SMTP_PASSWORD.encode())]
    subject = smtp_sink.messages[0]["Subject"]
    assert subject.startswith(f"[FIRING:1] TrainingLossNonFinite run {run.run}")
    for channel, body in {"slack": attachment["text"], "pagerduty": pagerduty["payload"]["custom_details"]["alerts"],
                          "email": mail}.items():
        text = " ".join(body.split())
        assert f"FIRING TrainingLossNonFinite [critical] run {run.run} rank 0:" in text, (channel, body)
        assert f"from step {run.nan_step}" in text and f"batch {run.nan_batch_id}" in text, (channel, body)
        assert f"Likely infra cause: {cause}" in text, (channel, body)
        assert annotations["dashboard_url"].startswith("https://grafana.example.org/d/")
        assert f"Dashboard: {annotations['dashboard_url']}" in text, (channel, body)
        assert f"Runbook: {annotations['runbook_url']}" in text, (channel, body)
    # One notification per run on every channel.
    assert len(http_sinks["slack"].notifications()) == len(smtp_sink.messages) == 1
    assert pipeline.notification_errors() == 0


def test_compose_passes_the_channels_and_mounts_their_secrets_read_only_in_its_overlay():
    """docker-compose.yml hands Alertmanager's entrypoint the channel variables; the overlay mounts
    deploy/compose/secrets/notify where render-config.sh looks by default."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["alertmanager"]
    assert {"DUALTRACK_CHANNELS", "DUALTRACK_EMAIL_TO", "DUALTRACK_SMTP_SMARTHOST"} <= compose["environment"].keys()
    overlay = yaml.safe_load((REPO / "deploy" / "compose" / "notifications.yml").read_text())
    (mount,) = overlay["services"]["alertmanager"]["volumes"]
    default = re.search(r"DUALTRACK_ALERTMANAGER_SECRETS:-([^}]+)\}", processes.ALERTMANAGER_RENDER.read_text())
    assert mount == {"type": "bind", "source": "./deploy/compose/secrets/notify", "target": default.group(1),
                     "read_only": True}
    assert "*" in (REPO / "deploy" / "compose" / "secrets" / ".gitignore").read_text().split()  # never committed


def test_the_render_script_leaves_no_temporary_file_even_when_it_execs(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "am.yml"
    result = subprocess.run(["sh", str(processes.ALERTMANAGER_RENDER), str(processes.ALERTMANAGER_YML), str(out),
                             "true"], capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "TMPDIR": str(scratch), "DUALTRACK_CHANNELS": "slack"})
    assert result.returncode == 0, result.stderr
    assert out.is_file() and list(scratch.iterdir()) == []


#: Markup a hostile run, job or rank name carries: a disguised Slack link and mention, a Markdown link
#: (Teams), HTML (email), and a line break that would fake a line of the message.
HOSTILE = {"run": "<https://evil.example|Open dashboard> <!channel>", "job": "[Open dashboard](https://evil.example)",
           "rank": "<b>0</b>\nDashboard: https://evil.example"}


def inert(text: str) -> bool:
    """No link, mention, tag or faked line a hostile value could have brought."""
    return not any(markup in text for markup in ("<https://evil", "<!channel>", "](https://evil", "<b>",
                                                 "\nDashboard: https://evil"))


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
def test_run_job_and_rank_values_cannot_inject_links_mentions_or_markup(tmp_path, start_service, http_sinks,
                                                                        smtp_sink):
    """A real Alertmanager with the repo's channels and templates, an alert carrying hostile values (in
    its labels and in the annotations the rules build from them) posted to its API: the Slack message
    (whose text Teams' channel shares), the email's text and HTML parts show the values, inert."""
    secrets = tmp_path / "notify"
    secrets.mkdir(mode=0o700)
    for name, value in {"slack-api-url": http_sinks["slack"].url, "pagerduty-routing-key": "k",
                        "smtp-password": SMTP_PASSWORD}.items():
        (secrets / name).write_text(value)
    config = processes.render_alertmanager_config(tmp_path, {
        "DUALTRACK_CHANNELS": "slack email", "DUALTRACK_ALERTMANAGER_SECRETS": str(secrets),
        "DUALTRACK_EMAIL_TO": "oncall@example.org", "DUALTRACK_EMAIL_FROM": "dualtrack@example.org",
        "DUALTRACK_SMTP_SMARTHOST": f"127.0.0.1:{smtp_sink.port}", "DUALTRACK_SMTP_USERNAME": SMTP_USER,
        "DUALTRACK_SMTP_REQUIRE_TLS": "false"}, group_wait="1s", group_interval="1s")
    alertmanager = start_service(processes.alertmanager(tmp_path, config))
    run = HOSTILE["run"]
    alert = {"labels": {"alertname": "TrainingLossNonFinite", "severity": "critical", **HOSTILE},
             "annotations": {"summary": f"loss is NaN in run {run}", "description": f"run {run} since step 3",
                             "dashboard_url": f"http://grafana.example/d/run?var-run={run}"}}
    assert requests.post(alertmanager.url + "/api/v2/alerts", json=[alert], timeout=10).status_code == 200
    slack = wait_until(lambda: http_sinks["slack"].notifications(), 60, what="the Slack message")[0]
    wait_until(lambda: smtp_sink.messages, 60, what="the email")
    message = smtp_sink.messages[0]
    attachment = slack["attachments"][0]
    html = message.get_body(("html",)).get_content()
    for part in (attachment["title"], attachment["text"], message["Subject"], smtp_sink.bodies()[0], html):
        assert inert(part), part
    assert "‹https://evil.example|Open dashboard› ‹!channel›" in attachment["text"]  # still readable
    assert "⁅Open dashboard⁆(https://evil.example)" in attachment["title"]
    assert "rank ‹b›0‹/b› Dashboard: https://evil.example" in attachment["text"]
