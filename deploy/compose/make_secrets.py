"""Make the TLS certificates, passwords and web-config files the compose stack needs (run once, before `up`).

    python3 deploy/compose/make_secrets.py [--host gpu-box.example.org --host 10.0.0.5] [--dir DIR] [--group GID]

Writes into deploy/compose/secrets/ (git-ignored), refusing to overwrite an existing file of the set
(--force replaces them; nothing else in the directory is ever touched):
- ca.crt, ca.key: a private CA (keep ca.key; copy ca.crt to every machine that pushes or scrapes);
- tls.crt, tls.key: the server certificate of every daemon (compose service names, localhost,
  127.0.0.1 and each --host);
- <daemon>-web.yml for pushgateway, prometheus, alertmanager and the exporter: exporter-toolkit
  web-config files (TLS, bcrypt basic auth) that each daemon reads with --web.config.file;
- <user>.password: one random password per client (hook, prometheus, grafana, admin, healthcheck).
  Only bcrypt hashes go into the web-config files. Each daemon accepts only the users it needs:
  `healthcheck` only on the exporter (the other daemons' health checks send no credentials);
- grafana-admin.password: Grafana's admin password (GF_SECURITY_ADMIN_PASSWORD__FILE).
Modes, set when each file is created (whatever the umask): certificates 0644; ca.key 0600; the other
keys, passwords and web-configs 0600, or 0640 with group --group (the containers' users read them
through that group: compose's `group_add`). A directory it creates is 0700 (0750 with --group).
Needs the openssl command and the bcrypt and PyYAML packages (installed with dualtrack; run it with the
environment dualtrack is installed in, or `apt-get install python3-bcrypt python3-yaml`).
"""
from __future__ import annotations

import argparse
import grp
import ipaddress
import os
import re
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import bcrypt
    import yaml
except ImportError as missing:  # the system python3 without them: one line, not a traceback
    sys.exit(f"make_secrets: error: the {missing.name} package is missing from {sys.executable}: run this "
             "script with the Python dualtrack is installed in (e.g. .venv/bin/python), or "
             "`apt-get install python3-bcrypt python3-yaml`")

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / "secrets"
SERVICES = ("exporter", "pushgateway", "prometheus", "alertmanager")
# Who may talk to each daemon, and no one else: the hook (and the janitor) push; Prometheus scrapes and
# sends alerts; Grafana queries; "admin" is you; "healthcheck" is the exporter image's own health check
# (the other daemons' checks send no credentials, so they need no user).
USERS = {
    "pushgateway": ("hook", "prometheus", "admin"),
    "prometheus": ("grafana", "prometheus", "admin"),
    "alertmanager": ("prometheus", "grafana", "admin"),
    "exporter": ("prometheus", "healthcheck"),
}
PASSWORD_USERS = tuple(dict.fromkeys(user for users in USERS.values() for user in users))
GRAFANA_ADMIN = "grafana-admin"  # Grafana's own admin login (a file: GF_SECURITY_ADMIN_PASSWORD__FILE), no web-config
#: Every file of the set and whether it is secret (0600, or 0640 with --group); the others are 0644.
FILES = {"ca.crt": False, "ca.key": True, "tls.crt": False, "tls.key": True,
         **{f"{service}-web.yml": True for service in USERS},
         **{f"{user}.password": True for user in (*PASSWORD_USERS, GRAFANA_ADMIN)}}
PRIVATE_TO_THE_OWNER = ("ca.key",)  # never shared with the group: only needed to add hosts later
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
BCRYPT_COST = 10  # htpasswd's default; the daemons cache successful checks, so this is paid once per client
DAYS = 825


class SecretsError(Exception):
    """A one-line reason to stop (exit 2)."""


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode:
        raise SecretsError(f"openssl {args[0]} failed: {result.stderr.strip().splitlines()[-1]}")


def check_host(host: str) -> str:
    """`host` if it is an IP address or a DNS name (letters, digits, hyphens, dots); else SecretsError.
    Nothing else may reach the certificate's OpenSSL config (a newline or comma would add entries)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    if not 0 < len(name) <= 253 or not all(_DNS_LABEL.fullmatch(label) for label in name.split(".")):
        raise SecretsError(f"--host {host!r} is neither a DNS name nor an IP address")
    return name


def _san(hosts: list[str]) -> str:
    names = []
    for host in dict.fromkeys(["localhost", "127.0.0.1", *SERVICES, *map(check_host, hosts)]):
        try:
            ipaddress.ip_address(host)
            names.append(f"IP:{host}")
        except ValueError:
            names.append(f"DNS:{host}")
    return ",".join(names)


def make_certificates(scratch: Path, hosts: list[str]) -> None:
    """ca.crt/ca.key and a server tls.crt/tls.key signed by it (EC P-256), made in the private `scratch`."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key",
             "-out", "ca.crt", "-days", str(DAYS), "-subj", "/CN=dualtrack CA", cwd=scratch)
    (scratch / "server.ext").write_text(f"subjectAltName={_san(hosts)}\nextendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "tls.key",
             "-subj", "/CN=dualtrack", "-out", "server.csr", cwd=scratch)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", str(DAYS), "-sha256", "-extfile", "server.ext", "-out", "tls.crt", cwd=scratch)


def web_config(users: dict[str, str]) -> dict:
    """An exporter-toolkit web-config: TLS with tls.crt/tls.key (next to it), bcrypt basic auth for `users`."""
    return {"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key", "min_version": "TLS12"},
            "basic_auth_users": {user: bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()
                                 for user, password in users.items()}}


def mode_of(name: str, group: int | None) -> int:
    """The mode file `name` of the set gets."""
    if not FILES[name]:
        return 0o644
    return 0o640 if group is not None and name not in PRIVATE_TO_THE_OWNER else 0o600


def _write(path: Path, data: bytes, mode: int, group: int | None) -> None:
    """Create `path` (never through an existing file or link) with exactly `mode`, whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        if group is not None and mode != 0o600:
            os.fchown(fd, -1, group)
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


def make_secrets(directory: Path, hosts: list[str], *, group: int | None = None,
                 force: bool = False) -> dict[str, str]:
    """Write the whole set into `directory` (created if missing); returns the passwords by user.

    Raises SecretsError (nothing written) when a file of the set exists, unless `force`.
    """
    existing = sorted(name for name in FILES if os.path.lexists(directory / name))
    if existing and not force:
        raise SecretsError(f"{directory} already holds {', '.join(existing)}: move them away, or pass --force "
                           "to replace the set (clients then need the new ca.crt and passwords)")
    if not directory.exists():
        directory.mkdir(parents=True, mode=0o700)
        if group is not None:
            os.chown(directory, -1, group)
        directory.chmod(0o700 if group is None else 0o750)  # exactly, whatever the umask
    passwords = {user: secrets.token_hex(16) for user in (*PASSWORD_USERS, GRAFANA_ADMIN)}
    with tempfile.TemporaryDirectory(prefix="make_secrets-") as scratch:  # 0700: keys are private while made
        make_certificates(Path(scratch), hosts)
        contents = {name: (Path(scratch) / name).read_bytes() for name in ("ca.crt", "ca.key", "tls.crt", "tls.key")}
    contents.update({f"{user}.password": f"{password}\n".encode() for user, password in passwords.items()})
    contents.update({f"{service}-web.yml": yaml.safe_dump(web_config({u: passwords[u] for u in users}),
                                                          sort_keys=False).encode()
                     for service, users in USERS.items()})
    for name in existing:  # only with force, and only the set's own names
        (directory / name).unlink()
    for name, data in contents.items():
        _write(directory / name, data, mode_of(name, group), group)
    return passwords


def _group(value: str) -> int:
    """argparse type: a group name or numeric id."""
    try:
        return int(value) if value.isdigit() else grp.getgrnam(value).gr_gid
    except KeyError:
        raise argparse.ArgumentTypeError(f"no group named {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                        help="a DNS name or IP address clients use to reach this host (repeatable)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"output directory (default {DEFAULT_DIR})")
    parser.add_argument("--group", type=_group, default=None, metavar="GROUP",
                        help="group (name or id) that may read the keys, passwords and web-configs the "
                             "containers need (mode 0640); default: owner only (0600)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing set (only the files this script writes)")
    args = parser.parse_args(argv)
    try:
        for host in args.host:
            check_host(host)
        make_secrets(args.dir, args.host, group=args.group, force=args.force)
    except SecretsError as exc:
        print(f"make_secrets: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"make_secrets: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {args.dir}: give training nodes ca.crt and the 'hook' user's hook.password "
          "(DUALTRACK_PUSHGATEWAY_USERNAME=hook, DUALTRACK_PUSHGATEWAY_PASSWORD, DUALTRACK_PUSHGATEWAY_CA_FILE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
