"""The exporter's web flags and landing page.

The flag names and the `[host]:port` syntax are exporter-toolkit's (v0.17.1, web/kingpinflag/flag.go:
--web.listen-address, --web.config.file); --web.telemetry-path is the usual exporter flag beside them.
Only one listen address is taken (exporter-toolkit repeats the flag) and there is no systemd socket
activation. The landing page is a short HTML list of links, not exporter-toolkit's templated page.
"""
from __future__ import annotations

import argparse

DEFAULT_LISTEN_ADDRESS = "127.0.0.1:9942"  # loopback unless asked (containers pass :9942)
DEFAULT_TELEMETRY_PATH = "/metrics"
PROBE_PATHS = ("/-/healthy", "/-/ready")


def check_listen_address(value: str) -> str:
    """Check a `[host]:port` listen address (argparse type); return it unchanged."""
    parse_listen_address(value)
    return value


def parse_listen_address(value: str) -> tuple[str, int]:
    """Split `[host]:port` (IPv6 hosts in brackets) into (host, port); "" host means all interfaces."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"listen address {value!r} is not [host]:port (e.g. :9942 or 127.0.0.1:9942)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"listen address {value!r}: write IPv6 hosts in brackets, e.g. [::1]:9942")
    return host, int(port)


def check_telemetry_path(value: str) -> str:
    """Check a telemetry path (argparse type); return it unchanged."""
    if not value.startswith("/") or value in ("/", *PROBE_PATHS) or any(c in value for c in "?# \t\r\n"):
        raise argparse.ArgumentTypeError(
            f"telemetry path {value!r} must be a path like /metrics (not /, /-/healthy or /-/ready)")
    return value


def add_web_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --web.listen-address, --web.telemetry-path and --web.config.file (dests web_listen_address, ...)."""
    parser.add_argument("--web.listen-address", dest="web_listen_address", metavar="[HOST]:PORT",
                        type=check_listen_address, default=DEFAULT_LISTEN_ADDRESS,
                        help="address to serve metrics on; an empty host means all interfaces (default %(default)s)")
    parser.add_argument("--web.telemetry-path", dest="web_telemetry_path", metavar="PATH", type=check_telemetry_path,
                        default=DEFAULT_TELEMETRY_PATH,
                        help="path under which metrics are served (default %(default)s)")
    parser.add_argument("--web.config.file", dest="web_config_file", metavar="FILE", default=None,
                        help="exporter-toolkit web config (TLS, basic auth); see docs/security.md")


def landing_page(telemetry_path: str) -> bytes:
    """The HTML served on /: links to the telemetry path and the probes."""
    link = _html_attribute(telemetry_path)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>dualtrack exporter</title></head>\n"
            f"<body><h1>dualtrack NVML exporter</h1>\n<ul><li><a href=\"{link}\">Metrics</a></li>\n"
            f"<li><a href=\"/-/healthy\">Health</a></li><li><a href=\"/-/ready\">Readiness</a></li></ul>\n"
            f"</body></html>\n").encode()


def _html_attribute(text: str) -> str:
    """`text` escaped for an HTML attribute, as html.escape(quote=True) does (whose module loads the
    table of every HTML entity: half a MB of memory for the five characters needed here)."""
    for raw, entity in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ('"', "&quot;"), ("'", "&#x27;")):
        text = text.replace(raw, entity)
    return text
