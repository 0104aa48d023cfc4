# dualtrack-exporter: NVML metrics for Prometheus on :9942.
#
#   docker build -t dualtrack-exporter .
#   docker run --rm --gpus all --pid host -p 127.0.0.1:9942:9942 dualtrack-exporter
#
# libnvidia-ml.so.1 is not in the image: the NVIDIA container runtime mounts the host driver's copy
# (NVIDIA_DRIVER_CAPABILITIES=utility is the minimum NVML needs; no compute, no root, no
# CAP_SYS_ADMIN). `--pid host` lets per-process metrics resolve names and pods; without it they keep
# only PIDs (or turn them off with --no-collector.processes).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility

WORKDIR /opt/dualtrack
COPY pyproject.toml README.md ./
COPY exporter ./exporter
COPY trainer_hook ./trainer_hook
COPY dualtrack ./dualtrack
RUN pip install . && rm -rf /opt/dualtrack/build \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin dualtrack

USER 10001:10001
EXPOSE 9942
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9942/-/ready', timeout=3)"
ENTRYPOINT ["dualtrack-exporter"]
