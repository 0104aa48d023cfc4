"""dualtrack's NVML exporter: per-GPU metrics for Prometheus, sampled in the background."""

__version__ = "0.1.0"
