"""Remote write vs the Pushgateway: N simulated ranks write every 5 s into a local Prometheus, on loopback.

    .venv/bin/python bench/bench_remote_write.py [--ranks 2000 10000] [--seconds 20] [--processes 4]
                                                  [--no-pushgateway]

Remote write: each rank POSTs, every 5 s at its own phase, what a real TrainingMonitor writes (its
last state, encoded by trainer_hook.remote_write with the rank's own job/run/rank/instance labels and
a fresh timestamp) to one real Prometheus started with --web.enable-remote-write-receiver and the
project's rules. Reported per N: samples/s accepted (2xx answers x samples per request) vs wanted,
write latency p50/p99, failed or dropped writes, Prometheus' CPU (cores) and RSS, head series.
Then, unless --no-pushgateway, the same N through bench_pushgateway.run_load (one Pushgateway as
shipped, scraped every 15 s): pushes/s, p99, Pushgateway and Prometheus CPU/RSS, side by side.
Everything listens on 127.0.0.1 only; every daemon is stopped at the end.
"""
from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from bench_exporter import rss_mb
from bench_pushgateway import GRACE, PUSH_INTERVAL, drive, hook_payload, load, percentile, run_load

from stack import processes
from tests.support import daemons
from trainer_hook import remote_write
from trainer_hook.contract import Snapshot


def hook_snapshot() -> Snapshot:
    """The state a real TrainingMonitor publishes after a few logged steps (no endpoint needed)."""
    from trainer_hook import TrainingMonitor
    config = {"model": "llama-7b", "optimizer": "adamw", "batch_size": 32, "lr": 3e-4, "seed": 1}
    with TrainingMonitor(job="bench", run="capture", pushgateway=False, push_interval=60, config=config,
                         rank=0, instance="node-0", gpu_uuid="GPU-00000000-0000-0000-0000-000000000000",
                         record_path=False) as monitor:
        for step in range(20):
            monitor.log({"loss": 2.0 / (step + 1), "learning_rate": 3e-4, "grad_norm": 1.5, "epoch": 0},
                        step=step, samples=32, tokens=32 * 2048)
    return monitor._latest  # the final published state


def _worker(port: int, ranks: list[int], total: int, seconds: float, start_at: float, snapshot: Snapshot,
            results: multiprocessing.Queue) -> None:
    """Write `snapshot` as each of `ranks` every PUSH_INTERVAL (bench_pushgateway.drive), each request a
    WriteRequest of that rank's series with the current time, as the hook's writer sends it."""
    messages = remote_write.messages()
    built = {}
    for rank in ranks:  # built once per rank; only the timestamps change per write
        one = remote_write.batch(snapshot, {"job": "bench", "run": "load", "rank": str(rank),
                                            "instance": f"node-{rank // 8}"}, 0.0)
        request = messages["WriteRequest"]()
        for labels, value in one.samples:
            series = request.timeseries.add()
            series.labels.extend(messages["Label"](name=k, value=v) for k, v in labels)
            series.samples.add(value=value)
        built[rank] = request
    snappy = remote_write._snappy()  # the hook's own codec
    headers = {"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
               "X-Prometheus-Remote-Write-Version": remote_write.PROTOCOL_VERSION, "User-Agent": "bench"}
    local = threading.local()
    lock = threading.Lock()

    def write(rank: int) -> bool:
        with lock:  # one rank's message is never written twice at once, but keep upb single-threaded
            request = built[rank]
            now = round(time.time() * 1000)
            for series in request.timeseries:
                series.samples[0].timestamp = now
            body = bytes(snappy.compress_raw(request.SerializeToString()))
        connection = getattr(local, "connection", None)
        if connection is None:
            connection = local.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=GRACE)
        try:
            connection.request("POST", daemons.REMOTE_WRITE_PATH, body=body, headers=headers)
            response = connection.getresponse()
            response.read()
            return 200 <= response.status < 300
        except (OSError, http.client.HTTPException):
            local.connection = None
            connection.close()
            return False

    drive(write, ranks, total, seconds, start_at, results)


def run_remote_write(ranks: int, seconds: float, workers: int, snapshot: Snapshot, workdir: Path) -> dict:
    """One Prometheus (remote-write receiver, the project's rules) under `ranks` writing ranks."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = processes.render_prometheus_config(workdir, {processes.PUSHGATEWAY_JOB: []})
    prometheus = processes.prometheus(workdir, config, extra_args=[daemons.REMOTE_WRITE_RECEIVER])
    prometheus.start()
    try:
        pid = prometheus.proc.pid
        latencies, lateness, errors, cpu, _ = load(_worker, prometheus.port, snapshot, ranks, seconds, workers,
                                                pid, lead=5.0)  # the workers build their requests first
        per_request = len(remote_write.batch(snapshot, {}, 0.0).samples)
        span = int(seconds / PUSH_INTERVAL) * PUSH_INTERVAL
        own = requests.get(prometheus.url + "/metrics", timeout=60).text
        head = next(float(line.split()[1]) for line in own.splitlines()
                    if line.startswith("prometheus_tsdb_head_series "))
        return {"ranks": ranks, "samples_per_request": per_request,
                "wanted_samples_per_s": ranks * per_request / PUSH_INTERVAL,
                "accepted_samples_per_s": len(latencies) * per_request / span,
                "errors": errors,
                "latency_p50_ms": percentile(latencies, 0.5) * 1000,
                "latency_p99_ms": percentile(latencies, 0.99) * 1000,
                "late_p99_ms": percentile(lateness, 0.99) * 1000,
                "prom_cpu_cores": cpu, "prom_rss_mib": rss_mb(pid),
                "head_series": head}
    finally:
        prometheus.stop()


ROWS = [("remote write: wanted samples/s", "wanted_samples_per_s", "{:.0f}"),
        ("remote write: accepted samples/s", "accepted_samples_per_s", "{:.0f}"),
        ("remote write: failed or dropped writes", "errors", "{:.0f}"),
        ("remote write: latency p50 (ms)", "latency_p50_ms", "{:.1f}"),
        ("remote write: latency p99 (ms)", "latency_p99_ms", "{:.1f}"),
        ("remote write: start lateness p99 (ms)", "late_p99_ms", "{:.0f}"),
        ("Prometheus (receiver) CPU (cores)", "prom_cpu_cores", "{:.2f}"),
        ("Prometheus (receiver) RSS (MiB)", "prom_rss_mib", "{:.0f}"),
        ("Prometheus head series", "head_series", "{:.0f}")]
PUSHGATEWAY_ROWS = [("Pushgateway: wanted pushes/s", "wanted_per_s", "{:.0f}"),
                    ("Pushgateway: achieved pushes/s", "achieved_per_s", "{:.0f}"),
                    ("Pushgateway: failed or dropped pushes", "errors", "{:.0f}"),
                    ("Pushgateway: push latency p99 (ms)", "latency_p99_ms", "{:.1f}"),
                    ("Pushgateway CPU (cores)", "pgw_cpu_cores", "{:.2f}"),
                    ("Pushgateway RSS (MiB)", "pgw_rss_mib", "{:.0f}"),
                    ("Prometheus scrape of it (ms)", "prom_scrape_ms", "{:.0f}"),
                    ("Prometheus samples per scrape (15 s)", "prom_scrape_samples", "{:.0f}"),
                    ("Prometheus RSS (MiB)", "prom_rss_mib", "{:.0f}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--seconds", type=float, default=20.0, help="write time per N (whole 5 s cycles)")
    parser.add_argument("--processes", type=int, default=4, help="load generator processes")
    parser.add_argument("--no-pushgateway", action="store_true", help="remote write only")
    args = parser.parse_args(argv)
    snapshot = hook_snapshot()
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.seconds:g} s per N, "
          f"every rank every {PUSH_INTERVAL:g} s", flush=True)
    written, pushed = [], []
    payload = None if args.no_pushgateway else hook_payload()
    with tempfile.TemporaryDirectory() as scratch:
        for ranks in args.ranks:
            written.append(run_remote_write(ranks, args.seconds, args.processes, snapshot,
                                            Path(scratch) / f"rw-{ranks}"))
            print(f"remote write N={ranks} done; load average {os.getloadavg()[0]:.1f}", flush=True)
            if not args.no_pushgateway:
                pushed.append(run_load(ranks, args.seconds, args.processes, payload,
                                       Path(scratch) / f"pgw-{ranks}"))
                print(f"Pushgateway N={ranks} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'':44}" + "".join(f"{'N=' + str(f['ranks']):>12}" for f in written))
    for rows, figures in ((ROWS, written), (PUSHGATEWAY_ROWS, pushed)):
        for label, key, fmt in rows if figures else ():
            print(f"{label:44}" + "".join(f"{fmt.format(f[key]):>12}" for f in figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
