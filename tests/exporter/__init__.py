"""Tests of the exporter daemon: collectors, NVML (simulated, faulted, real), HTTP, PID namespaces."""
