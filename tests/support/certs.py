"""Test-only PKI made at test time with the `openssl` CLI: a CA, a server cert for 127.0.0.1, a client cert.

No private key is committed: each test session makes fresh throw-away keys in its tmp dir.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest

#: The user and password of the secured Pushgateway (conftest.py's secure_pgw fixture).
USER, PASSWORD = "trainer", "s3cret-pw"


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path  # a CA that signed nothing here: clients trusting only it must fail


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(directory: Path, name: str, subject: str, extensions: str) -> None:
    """A key and a CA-signed certificate `name`.crt with the given v3 extensions."""
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
             "-subj", subject, "-out", f"{name}.csr", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=directory)


def make_pki(directory: Path) -> Pki:
    """Write a CA, a server certificate (SAN 127.0.0.1, localhost) and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed (apt-get install openssl)")
    directory.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2", "-subj", f"/CN=dualtrack test {ca}",
                 cwd=directory)
    _issue(directory, "server", "/CN=127.0.0.1",
           "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _issue(directory, "client", "/CN=prometheus",
           "subjectAltName=DNS:prometheus.test\nextendedKeyUsage=clientAuth\n")
    return Pki(directory / "ca.crt", directory / "server.crt", directory / "server.key",
               directory / "client.crt", directory / "client.key", directory / "other-ca.crt")


def bcrypt_hash(password: str, cost: int = 10) -> str:
    """A bcrypt hash as a user would put it in basic_auth_users (cost 10, the htpasswd default)."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode()
