"""Make the TLS certificates, passwords and web-config files the compose stack needs (run once, before `up`).

    python3 deploy/compose/make_secrets.py [--host gpu-box.example.org --host 10.0.0.5] [--dir DIR]

Writes into deploy/compose/secrets/ (git-ignored), refusing to overwrite an existing set:
- ca.crt, ca.key: a private CA (keep ca.key; copy ca.crt to every machine that pushes or scrapes);
- tls.crt, tls.key: the server certificate of every daemon (compose service names, localhost,
  127.0.0.1 and each --host);
- <daemon>-web.yml for pushgateway, prometheus, alertmanager and the exporter: exporter-toolkit
  web-config files (TLS, bcrypt basic auth) that each daemon reads with --web.config.file;
- <user>.password: one random password per client (hook, prometheus, grafana, admin, healthcheck).
  Only bcrypt hashes go into the web-config files.
Needs the openssl command and the bcrypt package (installed with dualtrack).
"""
from __future__ import annotations

import argparse
import ipaddress
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import bcrypt
import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / "secrets"
SERVICES = ("exporter", "pushgateway", "prometheus", "alertmanager")
# Who may talk to each daemon: the hook (and the janitor) push; Prometheus scrapes and sends alerts;
# Grafana queries; "admin" is you; "healthcheck" is the container's own health check.
USERS = {
    "pushgateway": ("hook", "prometheus", "admin", "healthcheck"),
    "prometheus": ("grafana", "prometheus", "admin", "healthcheck"),
    "alertmanager": ("prometheus", "grafana", "admin", "healthcheck"),
    "exporter": ("prometheus", "healthcheck"),
}
BCRYPT_COST = 10  # htpasswd's default; the daemons cache successful checks, so this is paid once per client
DAYS = 825


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"make_secrets: openssl {args[0]} failed: {result.stderr.strip().splitlines()[-1]}")


def _san(hosts: list[str]) -> str:
    names = []
    for host in dict.fromkeys(["localhost", "127.0.0.1", *SERVICES, *hosts]):
        try:
            ipaddress.ip_address(host)
            names.append(f"IP:{host}")
        except ValueError:
            names.append(f"DNS:{host}")
    return ",".join(names)


def make_certificates(directory: Path, hosts: list[str]) -> None:
    """ca.crt/ca.key and a server tls.crt/tls.key signed by it (EC P-256)."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key",
             "-out", "ca.crt", "-days", str(DAYS), "-subj", "/CN=dualtrack CA", cwd=directory)
    with tempfile.TemporaryDirectory() as scratch:
        extensions = Path(scratch) / "server.ext"
        extensions.write_text(f"subjectAltName={_san(hosts)}\nextendedKeyUsage=serverAuth\n")
        request = Path(scratch) / "server.csr"
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "tls.key",
                 "-subj", "/CN=dualtrack", "-out", str(request), cwd=directory)
        _openssl("x509", "-req", "-in", str(request), "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", str(DAYS), "-sha256", "-extfile", str(extensions), "-out", "tls.crt", cwd=directory)
    (directory / "ca.srl").unlink(missing_ok=True)


def web_config(users: dict[str, str]) -> dict:
    """An exporter-toolkit web-config: TLS with tls.crt/tls.key (next to it), bcrypt basic auth for `users`."""
    return {"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key", "min_version": "TLS12"},
            "basic_auth_users": {user: bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()
                                 for user, password in users.items()}}


def make_secrets(directory: Path, hosts: list[str]) -> dict[str, str]:
    """Write the whole set into `directory` (created); returns the passwords by user."""
    directory.mkdir(parents=True, exist_ok=True)
    make_certificates(directory, hosts)
    passwords = {user: secrets.token_hex(16) for user in dict.fromkeys(u for users in USERS.values() for u in users)}
    for user, password in passwords.items():
        (directory / f"{user}.password").write_text(password + "\n")
    for service, users in USERS.items():
        (directory / f"{service}-web.yml").write_text(
            yaml.safe_dump(web_config({user: passwords[user] for user in users}), sort_keys=False))
    # The daemons run as different users (nobody, grafana, 10001): they must all read their files.
    for path in directory.iterdir():
        path.chmod(0o600 if path.name == "ca.key" else 0o644)
    return passwords


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                        help="a name or address clients use to reach this host (repeatable)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"output directory (default {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    if (args.dir / "ca.crt").exists():
        print(f"make_secrets: {args.dir} already holds a set; move it away to make a new one", file=sys.stderr)
        return 2
    make_secrets(args.dir, args.host)
    print(f"wrote {args.dir}: give training nodes ca.crt and the 'hook' user's hook.password "
          "(DUALTRACK_PUSHGATEWAY_USERNAME=hook, DUALTRACK_PUSHGATEWAY_PASSWORD, DUALTRACK_PUSHGATEWAY_CA_FILE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
