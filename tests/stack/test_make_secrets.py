"""deploy/compose/make_secrets.py with the real openssl: modes, what it never touches, --host checks."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "deploy" / "compose"))
import make_secrets

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
PUBLIC = {"ca.crt", "tls.crt"}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def run(capsys, *args: str) -> tuple[int, str]:
    code = make_secrets.main(list(args))
    return code, capsys.readouterr().err


def test_keys_passwords_and_web_configs_are_owner_only_whatever_the_umask(tmp_path):
    old = os.umask(0)  # the most permissive umask: modes must not depend on it
    try:
        make_secrets.make_secrets(tmp_path / "set", hosts=[])
    finally:
        os.umask(old)
    modes = {path.name: mode(path) for path in (tmp_path / "set").iterdir()}
    assert set(modes) == set(make_secrets.FILES)
    assert {name for name, m in modes.items() if m == 0o644} == PUBLIC
    assert {name for name, m in modes.items() if m == 0o600} == set(modes) - PUBLIC
    assert mode(tmp_path / "set") == 0o700


def test_group_option_lets_the_containers_group_read_what_they_need_but_not_the_ca_key(tmp_path, capsys):
    group = os.getgid()  # a group this user may hand files to without root
    assert run(capsys, "--dir", str(tmp_path / "set"), "--group", str(group))[0] == 0
    for path in (tmp_path / "set").iterdir():
        expected = 0o644 if path.name in PUBLIC else 0o600 if path.name == "ca.key" else 0o640
        assert mode(path) == expected, path.name
        assert path.stat().st_gid == group
    assert mode(tmp_path / "set") == 0o750


def test_files_it_did_not_write_are_never_touched(tmp_path, capsys):
    directory = tmp_path / "set"
    directory.mkdir(mode=0o755)
    mine = directory / "my.key"
    mine.write_text("private\n")
    mine.chmod(0o600)
    assert run(capsys, "--dir", str(directory))[0] == 0
    assert mode(mine) == 0o600 and mine.read_text() == "private\n"
    assert mode(directory) == 0o755  # the directory existed: its mode is the user's


def test_an_existing_set_even_partial_is_never_overwritten_without_force(tmp_path, capsys):
    directory = tmp_path / "set"
    make_secrets.make_secrets(directory, hosts=[])
    (directory / "ca.crt").unlink()  # lost the certificate, still has the CA key and the passwords
    before = {path.name: path.read_bytes() for path in directory.iterdir()}
    code, err = run(capsys, "--dir", str(directory))
    assert code == 2 and err.count("\n") == 1 and "--force" in err and "Traceback" not in err
    assert {path.name: path.read_bytes() for path in directory.iterdir()} == before

    (directory / "notes.txt").write_text("keep me\n")
    assert run(capsys, "--dir", str(directory), "--force")[0] == 0
    assert (directory / "ca.key").read_bytes() != before["ca.key"]
    assert (directory / "hook.password").read_bytes() != before["hook.password"]
    assert (directory / "notes.txt").read_text() == "keep me\n"
    assert mode(directory / "ca.key") == 0o600


@pytest.mark.parametrize("host", ["gpu\nbasicConstraints=critical,CA:TRUE", "gpu,DNS:bank.example.com",
                                  "gpu box", "-gpu", "", "gpu..box", "a" * 64 + ".org"])
def test_a_host_that_is_neither_a_dns_name_nor_an_ip_address_is_a_one_line_error(tmp_path, capsys, host):
    code, err = run(capsys, "--dir", str(tmp_path / "set"), f"--host={host}")
    assert code == 2 and err.count("\n") == 1 and "neither a DNS name nor an IP address" in err
    assert not (tmp_path / "set").exists()


def test_dns_names_and_ip_addresses_become_exactly_their_san_entries(tmp_path, capsys):
    assert run(capsys, "--dir", str(tmp_path / "set"), "--host", "gpu-box.example.org", "--host", "10.0.0.5",
               "--host", "fd00::5")[0] == 0
    text = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "set" / "tls.crt"), "-noout", "-text"],
                          capture_output=True, text=True, check=True).stdout
    san = text.split("X509v3 Subject Alternative Name:")[1].splitlines()[1].strip()
    assert san.split(", ") == ["DNS:localhost", "IP Address:127.0.0.1", "DNS:exporter", "DNS:pushgateway",
                               "DNS:prometheus", "DNS:alertmanager", "DNS:gpu-box.example.org",
                               "IP Address:10.0.0.5", "IP Address:FD00:0:0:0:0:0:0:5"]
    assert "CA:TRUE" not in text


def test_each_daemon_accepts_only_the_users_it_needs_and_healthcheck_only_the_exporter(tmp_path):
    make_secrets.make_secrets(tmp_path, hosts=[])
    users = {service: set(yaml.safe_load((tmp_path / f"{service}-web.yml").read_text())["basic_auth_users"])
             for service in make_secrets.SERVICES}
    assert users == {"pushgateway": {"hook", "prometheus", "admin"},
                     "prometheus": {"grafana", "prometheus", "admin"},
                     "alertmanager": {"prometheus", "grafana", "admin"},
                     "exporter": {"prometheus", "healthcheck"}}
    assert (tmp_path / "grafana-admin.password").read_text().strip()  # Grafana's login: no web-config user
    assert not any("grafana-admin" in names for names in users.values())


@pytest.mark.parametrize("package", ["bcrypt", "yaml"])
def test_a_python_without_bcrypt_or_yaml_gets_one_line_not_a_traceback(tmp_path, package):
    """The README runs it with the system python3, which may lack bcrypt (Debian's lacks it)."""
    blocked = f"import sys, runpy; sys.modules[{package!r}] = None; sys.argv = ['make_secrets.py', '--dir', " \
              f"{str(tmp_path / 'set')!r}]; runpy.run_path({str(REPO / 'deploy/compose/make_secrets.py')!r}, " \
              "run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"make_secrets: error: the {package} package is missing"), result.stderr
    assert not (tmp_path / "set").exists()
