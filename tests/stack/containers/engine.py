"""Podman as a Docker engine for docker-compose, on a machine with no registry and no systemd.

- `Podman`: podman with its own containers.conf, storage.conf and registries.conf (the host's
  /etc/containers is left alone), its Docker-compatible API service and a health-check runner
  (podman runs health checks through systemd timers, which a container or CI machine lacks).
- `ensure_images`: the images the compose file names, built locally as an air-gapped site mirrors
  them: Debian rootfs tarballs from `mmdebstrap`, a small Containerfile on top (this folder).

The store (images, layer cache) lives in a cache folder that a later run reuses; an empty cache is
filled from scratch. Recipe and caveats: docs/podman.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("TMPDIR") or "/tmp") / "dualtrack-containers-cache"
DEBIAN = os.environ.get("DUALTRACK_DEBIAN_MIRROR", "http://deb.debian.org/debian")
TOOLS = ("podman", "runc", "mmdebstrap", "docker-compose")

# name the compose file / Dockerfile uses -> (rootfs, Containerfile, build target)
PYTHON_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3", "passwd", "ca-certificates")
PROMETHEUS_PACKAGES = ("prometheus", "prometheus-pushgateway", "prometheus-alertmanager", "busybox")
ROOTFS = {"python": PYTHON_PACKAGES, "prometheus": PROMETHEUS_PACKAGES}
IMAGES = {
    "docker.io/library/python:3.11-slim": ("python", "python.Containerfile", None),
    "docker.io/prom/prometheus:v2.53.0": ("prometheus", "prometheus.Containerfile", "prometheus"),
    "docker.io/prom/pushgateway:v1.9.0": ("prometheus", "prometheus.Containerfile", "pushgateway"),
    "docker.io/prom/alertmanager:v0.27.0": ("prometheus", "prometheus.Containerfile", "alertmanager"),
}


class EngineError(RuntimeError):
    pass


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


class Podman:
    """podman with its configuration under `cache`; `start()` runs the API service and health checks."""

    def __init__(self, cache: Path = CACHE) -> None:
        self.cache = cache
        self.conf = cache / "conf"
        self.socket = cache / "run" / "podman.sock"
        self.env = {**os.environ,
                    "CONTAINERS_CONF": str(self.conf / "containers.conf"),
                    "CONTAINERS_STORAGE_CONF": str(self.conf / "storage.conf"),
                    "CONTAINERS_REGISTRIES_CONF": str(self.conf / "registries.conf"),
                    "DOCKER_HOST": f"unix://{self.socket}"}
        self._service: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._checker: threading.Thread | None = None
        self.health_errors: list[str] = []

    def configure(self) -> None:
        for folder in ("conf", "storage", "run", "tmp", "networks"):
            (self.cache / folder).mkdir(parents=True, exist_ok=True)
        # crun and raised ulimits are refused on this machine kind; runc and no default ulimits work.
        (self.conf / "containers.conf").write_text(
            "[containers]\ndefault_ulimits = []\n"
            f'[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\nevents_logger = "file"\n'
            f'events_logfile_path = "{self.cache}/run/events.log"\ntmp_dir = "{self.cache}/tmp"\n'
            f'[network]\nnetwork_config_dir = "{self.cache}/networks"\n')
        (self.conf / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{self.cache}/storage"\n'
            f'runroot = "{self.cache}/run/storage"\n')
        (self.conf / "registries.conf").write_text('unqualified-search-registries = ["docker.io"]\n'
                                                    'short-name-mode = "permissive"\n')

    def __call__(self, *args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(["podman", "--tmpdir", str(self.cache / "tmp"), *args], env=self.env,
                                capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and result.returncode:
            raise EngineError(f"podman {' '.join(args[:3])}: {(result.stderr or result.stdout).strip()[-2000:]}")
        return result

    def start(self) -> None:
        """The Docker-compatible API on a socket of our own, and the health-check runner."""
        self.configure()
        self.socket.unlink(missing_ok=True)
        self._service = subprocess.Popen(
            ["podman", "--tmpdir", str(self.cache / "tmp"), "system", "service", "--time=0", f"unix://{self.socket}"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=open(self.cache / "run" / "service.log", "w"),
            start_new_session=True)
        deadline = time.monotonic() + 60
        while not self._ping():
            if self._service.poll() is not None or time.monotonic() > deadline:
                service_log = (self.cache / "run" / "service.log").read_text()
                raise EngineError(f"podman system service did not answer: {service_log[-1000:]}")
            time.sleep(0.2)
        self._checker = threading.Thread(target=self._run_health_checks, name="healthchecks", daemon=True)
        self._checker.start()

    def _ping(self) -> bool:
        import http.client
        import socket

        class Unix(http.client.HTTPConnection):
            def connect(conn) -> None:
                conn.sock = socket.socket(socket.AF_UNIX)
                conn.sock.settimeout(5)
                conn.sock.connect(str(self.socket))
        try:
            connection = Unix("localhost")
            connection.request("GET", "/_ping")
            return connection.getresponse().status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self._stop.set()
        if self._checker:
            self._checker.join(timeout=60)
        if self._service and self._service.poll() is None:
            self._service.send_signal(signal.SIGTERM)
            try:
                self._service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._service.kill()
                self._service.wait()

    def _run_health_checks(self) -> None:
        """Run each container's health check on its interval, counted from when it was first seen
        running, as Docker does (the first check one interval after the start)."""
        due: dict[str, float] = {}
        intervals: dict[str, float] = {}
        while not self._stop.wait(1):
            try:
                running = self("ps", "-q", "--no-trunc", "--filter", "status=running", timeout=60).stdout.split()
                for cid in set(running) - set(intervals):
                    info = json.loads(self("inspect", cid, timeout=60).stdout)[0]
                    check = info["Config"].get("Healthcheck") or {}
                    test = check.get("Test") or []
                    enabled = bool(test) and test[0] != "NONE"
                    intervals[cid] = (check.get("Interval") or 30e9) / 1e9 if enabled else 0
                    due[cid] = time.monotonic() + intervals[cid]
                for cid in running:
                    if intervals.get(cid) and time.monotonic() >= due[cid]:
                        self("healthcheck", "run", cid, check=False, timeout=120)
                        due[cid] = time.monotonic() + intervals[cid]
                for cid in set(intervals) - set(running):  # stopped: counted afresh if started again
                    del intervals[cid], due[cid]
            except (EngineError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
                self.health_errors.append(str(exc))

    def remove_build_leftovers(self) -> None:
        """Builds cut short (the API service stopped mid-build) leave buildah working containers that
        hold overlay mounts; this store is ours alone, so every such container goes."""
        listed = self("ps", "-a", "--external", "--format", "{{.ID}} {{.Names}}", check=False).stdout.splitlines()
        for line in listed:
            cid, _, name = line.partition(" ")
            if name.endswith("-working-container"):
                self("rm", "-f", "--storage", cid, check=False)

    def image_label(self, image: str, label: str) -> str | None:
        result = self("image", "inspect", "--format", f'{{{{index .Labels "{label}"}}}}', image, check=False)
        return result.stdout.strip() if result.returncode == 0 else None


def _recipe(rootfs: str, containerfile: str) -> str:
    """What an image is made of: a changed package list or Containerfile rebuilds it."""
    text = " ".join(ROOTFS[rootfs]) + DEBIAN + (HERE / containerfile).read_text()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _site_pip_context(context: Path) -> None:
    """This site's package-index access for pip inside builds: its CA bundle and /etc/pip.conf."""
    bundle = Path(os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
    shutil.copyfile(bundle, context / "ca-certificates.crt")
    pip_conf = Path("/etc/pip.conf")
    text = pip_conf.read_text() if pip_conf.exists() else "[global]\n"
    if os.environ.get("PIP_INDEX_URL"):
        text += f"index-url = {os.environ['PIP_INDEX_URL']}\n"
    (context / "pip.conf").write_text(text)


def ensure_images(podman: Podman, log=print) -> None:
    """Build each stand-in image unless the store already holds it from the same recipe."""
    stale = {image: spec for image, spec in IMAGES.items()
             if podman.image_label(image, "org.dualtrack.recipe") != _recipe(spec[0], spec[1])}
    if not stale:
        return
    with tempfile.TemporaryDirectory(dir=podman.cache / "tmp") as scratch:
        scratch = Path(scratch)
        started = time.monotonic()
        # Both rootfs at once: mostly downloads and dpkg, which a 2-core machine overlaps well.
        debootstraps = {rootfs: subprocess.Popen(
            ["mmdebstrap", "--variant=minbase", "--format=tar", "--include=" + ",".join(ROOTFS[rootfs]),
             "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
             "--dpkgopt=path-exclude=/usr/share/locale/*", "bookworm", str(scratch / f"{rootfs}.tar"), DEBIAN],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(scratch / f"{rootfs}.log", "w"))
            for rootfs in {spec[0] for spec in stale.values()}}
        try:
            for rootfs, process in debootstraps.items():
                if process.wait(timeout=900):
                    raise EngineError(f"mmdebstrap {rootfs}: {(scratch / f'{rootfs}.log').read_text().strip()[-2000:]}")
                podman("import", str(scratch / f"{rootfs}.tar"), f"localhost/dualtrack-rootfs-{rootfs}:bookworm")
        finally:
            for process in debootstraps.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
        log(f"rootfs {', '.join(debootstraps)}: {time.monotonic() - started:.0f} s")
        for image, (rootfs, containerfile, target) in stale.items():
            context = scratch / image.replace("/", "_").replace(":", "_")
            context.mkdir()
            shutil.copy(HERE / containerfile, context / "Containerfile")
            _site_pip_context(context)
            podman("build", "--pull=never", "--label", f"org.dualtrack.recipe={_recipe(rootfs, containerfile)}",
                   "-t", image, *(["--target", target] if target else []), "-f", str(context / "Containerfile"),
                   str(context))
            log(f"built {image}")
