# dualtrack: the NVML exporter (entrypoint) and the `dualtrack` command (e.g. `dualtrack janitor`).
#
#   docker build -t dualtrack .
#   docker run --rm --gpus all --pid host -p 127.0.0.1:9942:9942 dualtrack
#
# XIDs from the kernel log need /dev/kmsg and CAP_SYSLOG, which Docker gives to uid 0 only: add
# `--device /dev/kmsg:/dev/kmsg:r --cap-drop ALL --cap-add SYSLOG --cap-add SETUID --cap-add SETGID
# --user 0:0` (docs/metrics.md). Started as root, the exporter opens /dev/kmsg and its port, then serves
# as DUALTRACK_EXPORTER_RUN_AS (10001:10001) with no capability left, or refuses to serve.
# libnvidia-ml.so.1 is not in the image: the NVIDIA container runtime mounts the host driver's copy
# (NVIDIA_DRIVER_CAPABILITIES=utility is the minimum NVML needs; no compute, no root, no
# CAP_SYS_ADMIN). `--pid host` lets per-process metrics resolve names and pods; without it they keep
# only PIDs (or turn them off with --no-collector.processes). The `kubernetes` extra (grpcio) is
# installed for --collector.podresources. The bare daemon listens on 127.0.0.1 only; in the image it
# listens on every interface of the container (DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS=:9942), and the
# published port (-p 127.0.0.1:9942:9942) decides who reaches it.
# The health check follows the exporter's TLS and basic auth: set DUALTRACK_EXPORTER_WEB_CONFIG_FILE
# (not the flag) and DUALTRACK_HEALTHCHECK_PASSWORD_FILE (see deploy/healthcheck.py).
# The base image by digest (docs/security.md lists every image's digest); a site that mirrors it under
# another name passes --build-arg PYTHON_IMAGE=... (the container test does, with its stand-in).
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility \
    DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS=:9942 \
    DUALTRACK_EXPORTER_RUN_AS=10001:10001

WORKDIR /opt/dualtrack
COPY pyproject.toml README.md ./
COPY exporter ./exporter
COPY trainer_hook ./trainer_hook
COPY dualtrack ./dualtrack
COPY deploy/healthcheck.py ./healthcheck.py
# Every Python package pinned (deploy/constraints.txt): the image installs what CI tested.
COPY deploy/constraints.txt ./constraints.txt
# Two users: the exporter (10001, the image's default) and the janitor (10002, compose `user:`), so that
# the exporter, which shares the host's PID namespace, cannot read the janitor's /proc/<pid>/environ.
RUN pip install -c constraints.txt ".[kubernetes]" && rm -rf /opt/dualtrack/build \
    && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin dualtrack \
    && useradd --system --uid 10002 --user-group --no-create-home --shell /usr/sbin/nologin dualtrack-janitor

USER 10001:10001
EXPOSE 9942
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s CMD ["python", "/opt/dualtrack/healthcheck.py", "/-/ready"]
ENTRYPOINT ["dualtrack-exporter"]
