"""The exporter image's health check: GET a probe path (default /-/ready) on the container's own port,
with TLS and basic auth when the exporter has them.

    python healthcheck.py [/-/ready | /-/healthy]

Reads what the exporter reads: DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS (default :9942) and
DUALTRACK_EXPORTER_WEB_CONFIG_FILE (TLS when it has tls_server_config). Basic auth as
DUALTRACK_HEALTHCHECK_USERNAME (default "healthcheck") with the password in the file
DUALTRACK_HEALTHCHECK_PASSWORD_FILE. The certificate is not verified: the check only ever talks to
127.0.0.1 inside the container. Exit 0 when ready, 1 otherwise (one line on stderr).
"""
from __future__ import annotations

import base64
import os
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

import yaml


def main() -> int:
    environ = os.environ
    port = environ.get("DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS", ":9942").rsplit(":", 1)[1]
    config_file = environ.get("DUALTRACK_EXPORTER_WEB_CONFIG_FILE")
    password_file = environ.get("DUALTRACK_HEALTHCHECK_PASSWORD_FILE")
    try:
        config = (yaml.safe_load(Path(config_file).read_text()) or {}) if config_file else {}
        password = Path(password_file).read_text().strip() if password_file else None
    except (OSError, yaml.YAMLError) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    tls = "tls_server_config" in config
    path = sys.argv[1] if len(sys.argv) > 1 else "/-/ready"
    request = urllib.request.Request(f"{'https' if tls else 'http'}://127.0.0.1:{port}{path}")
    if password is not None:
        user = environ.get("DUALTRACK_HEALTHCHECK_USERNAME", "healthcheck")
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    context = ssl._create_unverified_context() if tls else None  # our own loopback port
    try:
        with urllib.request.urlopen(request, timeout=3, context=context) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"healthcheck: {request.full_url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
