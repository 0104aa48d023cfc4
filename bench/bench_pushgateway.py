"""Pushgateway load: N simulated ranks each PUT the hook's full payload every 5 s, on loopback, for a bounded time.

    .venv/bin/python bench/bench_pushgateway.py [--ranks 100 1000 4000] [--seconds 30] [--processes 4]
        [--push-interval 5] [--hook-client]

The payload is what a real TrainingMonitor pushes (captured once from its final PUT: loss, learning
rate, grad norm, epoch, samples, tokens, a GPU and a config), sent under each rank's own grouping key
(job/run/rank/instance) by `--processes` worker processes, each rank at its own phase of the interval.
One real Pushgateway (in memory) and one real Prometheus scraping it every 15 s (the stack's default)
run for each N. Reported per N: pushes/s achieved vs wanted, the share of pushes that landed within one
push interval of when they were due (the ceiling docs/scaling.md states is the largest N where it is at
least 99 %), push latency p50/p99, how late pushes
started (> 0: the load generator itself could not keep up), the Pushgateway's CPU (cores) and RSS,
its /metrics size and time to fetch, Prometheus' own scrape_duration_seconds and
scrape_samples_scraped for it, head series and Prometheus RSS per million series.
With --hook-client each rank pushes through the hook's own HTTP client (trainer_hook.push.make_handler,
one per rank as each rank's TrainingMonitor has one) instead of a bare keep-alive http.client
connection, through a relay that counts the TCP connections the Pushgateway is asked to accept:
reported as connections per push after each rank's first (a handshake each; 1.0 is a new connection
for every push, 0 is one connection per rank kept open). Use a push interval the machine sustains
(pushes started close to ranks x cycles): a rank that pushes once shows no reuse.
Everything listens on 127.0.0.1 only; every daemon is stopped at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from bench_exporter import cpu_seconds, rss_mb

from stack import processes
from tests.support import daemons

PUSH_INTERVAL = 5.0
IN_FLIGHT = 32  # concurrent pushes per load-generator process
GRACE = 10.0  # seconds a push may take (and queued pushes may wait) after the last one was due
SCRAPE_INTERVAL = "15s"
TEXT_FORMAT = "text/plain; version=0.0.4"


def hook_payload() -> bytes:
    """The body of a real TrainingMonitor's push (its last PUT, after a few logged steps)."""
    from trainer_hook import TrainingMonitor
    bodies: list[bytes] = []

    class Capture(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:  # http.server's naming
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = {"model": "llama-7b", "optimizer": "adamw", "batch_size": 32, "lr": 3e-4, "seed": 1}
    with tempfile.TemporaryDirectory() as scratch:
        with TrainingMonitor(job="bench", run="capture", pushgateway=f"http://127.0.0.1:{server.server_port}",
                             push_interval=60, config=config, rank=0, instance="node-0", delete_after=None,
                             gpu_uuid="GPU-00000000-0000-0000-0000-000000000000",
                             record_path=Path(scratch) / "r.jsonl") as monitor:
            for step in range(20):
                monitor.log({"loss": 2.0 / (step + 1), "learning_rate": 3e-4, "grad_norm": 1.5, "epoch": 0},
                            step=step, samples=32, tokens=32 * 2048)
    server.shutdown()
    return bodies[-1]


def _worker(port: int, ranks: list[int], total: int, seconds: float, start_at: float, payload: bytes,
            results: multiprocessing.Queue) -> None:
    """PUT `payload` under each of `ranks`' grouping keys every PUSH_INTERVAL (see drive)."""
    local = threading.local()

    def push(rank: int) -> bool:
        connection = getattr(local, "connection", None)
        if connection is None:
            connection = local.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=GRACE)
        try:
            connection.request("PUT", _group(rank), body=payload, headers={"Content-Type": TEXT_FORMAT})
            response = connection.getresponse()
            response.read()
            return response.status in (200, 202)
        except (OSError, http.client.HTTPException):
            local.connection = None
            connection.close()
            return False

    drive(push, ranks, total, seconds, start_at, results)


def _group(rank: int) -> str:
    """The path a rank pushes to: its grouping key."""
    return f"/metrics/job/bench/run/load/rank/{rank}/instance/node-{rank // 8}"


def _hook_worker(port: int, ranks: list[int], total: int, seconds: float, start_at: float, payload: bytes,
                 results: multiprocessing.Queue) -> None:
    """As _worker, but each rank PUTs through its own handler of the hook (trainer_hook.push.make_handler:
    whatever HTTP client the hook under test uses, with its connection handling)."""
    from trainer_hook.push import make_handler
    url = f"http://127.0.0.1:{port}"
    handlers = {rank: make_handler(SimpleNamespace(pushgateway=url, basic_auth=None, bearer_token=None, ca_file=None,
                                                   client_cert=None, tls_verify=True)) for rank in ranks}

    def push(rank: int) -> bool:
        try:
            handlers[rank](url=url + _group(rank), method="PUT", timeout=GRACE,
                           headers=[("Content-Type", TEXT_FORMAT)], data=payload)()
        except Exception:  # noqa: BLE001 - any failure is a failed push
            return False
        return True

    drive(push, ranks, total, seconds, start_at, results)


def _relay(upstream: int, ports: multiprocessing.Queue, accepted: Any) -> None:
    """Relay each connection accepted on a free loopback port (put on `ports`) to 127.0.0.1:`upstream`,
    counting them in `accepted` (a multiprocessing.Value)."""
    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with accepted.get_lock():
            accepted.value += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def serve() -> None:
        server = await asyncio.start_server(relay, "127.0.0.1", 0, backlog=4096)
        ports.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(serve())


def drive(send: Callable[[int], bool], ranks: list[int], total: int, seconds: float, start_at: float,
          results: multiprocessing.Queue) -> None:
    """Call `send(rank)` (True: accepted) for `ranks` every PUSH_INTERVAL from start_at for `seconds`,
    each rank at its own phase; report (latencies, lateness, errors) on `results`.

    At most IN_FLIGHT sends per process run at once; sends still queued GRACE seconds after the last
    one was due are dropped (counted as errors), so a saturated receiver cannot stretch the run.
    """
    latencies: list[float] = []
    lateness: list[float] = []
    errors = [0]
    on_time = [0]  # accepted within one push interval of when it was due

    def timed(rank: int, due: float) -> None:
        started = time.time()
        ok = send(rank)
        finished = time.time()
        lateness.append(started - due)
        if ok:
            latencies.append(finished - started)
            on_time[0] += finished - due <= PUSH_INTERVAL
        else:
            errors[0] += 1

    schedule = sorted((start_at + cycle * PUSH_INTERVAL + PUSH_INTERVAL * rank / total, rank)
                      for cycle in range(int(seconds / PUSH_INTERVAL)) for rank in ranks)
    pool = ThreadPoolExecutor(max_workers=IN_FLIGHT)
    futures = []
    for due, rank in schedule:
        delay = due - time.time()
        if delay > 0:
            time.sleep(delay)
        futures.append(pool.submit(timed, rank, due))
    wait(futures, timeout=GRACE)
    dropped = sum(future.cancel() for future in futures)
    pool.shutdown(wait=True)
    results.put((latencies, lateness, errors[0] + dropped, on_time[0]))


def load(worker: Callable[..., None], port: int, payload: object, ranks: int, seconds: float, workers: int,
         pid: int, lead: float) -> tuple[list[float], list[float], int, float, int]:
    """Run `worker(port, its ranks, ranks, seconds, start_at, payload, results)` in `workers` processes,
    starting `lead` seconds from now; (latencies, lateness, errors, CPU cores of process `pid` after
    the first cycle, sends accepted within one push interval of when they were due)."""
    results: multiprocessing.Queue = multiprocessing.Queue()
    start_at = time.time() + lead
    procs = [multiprocessing.Process(target=worker, args=(port, list(range(i, ranks, workers)), ranks, seconds,
                                                          start_at, payload, results))
             for i in range(workers)]
    for proc in procs:
        proc.start()
    time.sleep(max(0.0, start_at + PUSH_INTERVAL - time.time()))  # the first cycle creates the series
    cpu_before, wall_before = cpu_seconds(pid), time.time()
    gathered = [results.get(timeout=seconds + 3 * GRACE + 60) for _ in procs]
    cpu = (cpu_seconds(pid) - cpu_before) / (time.time() - wall_before)
    for proc in procs:
        proc.join()
    return ([x for got in gathered for x in got[0]], [x for got in gathered for x in got[1]],
            sum(got[2] for got in gathered), cpu, sum(got[3] for got in gathered))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_load(ranks: int, seconds: float, workers: int, payload: bytes, workdir: Path,
             pushgateway_args: list[str] | None = None, hook_client: bool = False) -> dict[str, float]:
    """One Pushgateway (as shipped, plus `pushgateway_args`) + Prometheus under `ranks` pushing ranks
    (`hook_client`: through the hook's client and a counting relay); the figures of that run."""
    workdir.mkdir(parents=True, exist_ok=True)
    pushgateway = processes.pushgateway(workdir)
    pushgateway.argv += pushgateway_args or []
    pushgateway.start()
    prometheus = relay = None
    accepted = multiprocessing.Value("q", 0)
    try:
        config = processes.render_prometheus_config(workdir, {processes.PUSHGATEWAY_JOB: [pushgateway.address]},
                                                    scrape_interval=SCRAPE_INTERVAL)
        prometheus = processes.prometheus(workdir, config, extra_args=["--enable-feature=extra-scrape-metrics"])
        prometheus.start()
        pid, port = pushgateway.proc.pid, pushgateway.port
        if hook_client:
            ports: multiprocessing.Queue = multiprocessing.Queue()
            relay = multiprocessing.Process(target=_relay, args=(port, ports, accepted), daemon=True)
            relay.start()
            port = ports.get(timeout=30)
        latencies, lateness, errors, cpu, on_time = load(_hook_worker if hook_client else _worker, port, payload,
                                                         ranks, seconds, workers, pid, lead=1.0)
        pushes = ranks * int(seconds / PUSH_INTERVAL)
        started = time.perf_counter()
        body = requests.get(pushgateway.url + "/metrics", timeout=60).content
        fetch = time.perf_counter() - started
        rss = rss_mb(pid)
        scrape = daemons.wait_for_series(prometheus.url, 'scrape_duration_seconds{job="pushgateway"}', timeout=40)
        samples = daemons.query(prometheus.url, 'scrape_samples_scraped{job="pushgateway"}')
        size = daemons.query(prometheus.url, 'scrape_body_size_bytes{job="pushgateway"}')
        own = requests.get(prometheus.url + "/metrics", timeout=10).text
        head = next(float(line.split()[1]) for line in own.splitlines()
                    if line.startswith("prometheus_tsdb_head_series "))
        return {"ranks": ranks, "wanted_per_s": ranks / PUSH_INTERVAL,
                "achieved_per_s": len(latencies) / (int(seconds / PUSH_INTERVAL) * PUSH_INTERVAL),
                "errors": errors,
                "on_time_pct": 100 * on_time / pushes,
                "connections": accepted.value, "pushes_started": len(lateness),
                # each rank's first push opens a connection whatever the client: the rest tell reuse
                "connections_per_push": (accepted.value - ranks) / max(1, len(lateness) - ranks),
                "latency_p50_ms": percentile(latencies, 0.5) * 1000,
                "latency_p99_ms": percentile(latencies, 0.99) * 1000,
                "late_p99_ms": percentile(lateness, 0.99) * 1000, "pgw_cpu_cores": cpu, "pgw_rss_mib": rss,
                "metrics_bytes": len(body), "metrics_fetch_ms": fetch * 1000,
                "prom_scrape_ms": float(scrape[0]["value"][1]) * 1000,
                "prom_scrape_samples": float(samples[0]["value"][1]) if samples else float("nan"),
                "prom_scrape_body_bytes": float(size[0]["value"][1]) if size else float("nan"),
                "head_series": head,
                "prom_rss_mib": rss_mb(prometheus.proc.pid)}
    finally:
        if relay is not None:
            relay.terminate()
            relay.join()
        if prometheus is not None:
            prometheus.stop()
        pushgateway.stop()


ROWS = [("wanted pushes/s", "wanted_per_s", "{:.0f}"), ("achieved pushes/s", "achieved_per_s", "{:.0f}"),
        ("failed or dropped pushes", "errors", "{:.0f}"),
        ("pushes landed within one push interval (%)", "on_time_pct", "{:.1f}"),
        ("push latency p50 (ms)", "latency_p50_ms", "{:.1f}"),
        ("push latency p99 (ms)", "latency_p99_ms", "{:.1f}"),
        ("push start lateness p99 (ms; queued behind busy pushes)", "late_p99_ms", "{:.0f}"),
        ("Pushgateway CPU (cores)", "pgw_cpu_cores", "{:.2f}"), ("Pushgateway RSS (MiB)", "pgw_rss_mib", "{:.0f}"),
        ("/metrics size (MB)", "metrics_bytes", "{:.1f}", 1e-6), ("/metrics fetch (ms)", "metrics_fetch_ms", "{:.0f}"),
        ("Prometheus scrape_duration_seconds (ms)", "prom_scrape_ms", "{:.0f}"),
        ("Prometheus scrape_samples_scraped", "prom_scrape_samples", "{:.0f}"),
        ("Prometheus scrape body (MB)", "prom_scrape_body_bytes", "{:.1f}", 1e-6),
        ("Prometheus head series", "head_series", "{:.0f}"), ("Prometheus RSS (MiB)", "prom_rss_mib", "{:.0f}")]
HOOK_CLIENT_ROWS = [("pushes started (--hook-client)", "pushes_started", "{:.0f}"),
                    ("TCP connections accepted", "connections", "{:.0f}"),
                    ("TCP connections per push after each rank's first", "connections_per_push", "{:.3f}")]


def main(argv: list[str] | None = None) -> int:
    global PUSH_INTERVAL  # set from --push-interval; the load generators are forked: they see it
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[100, 1000, 4000])
    parser.add_argument("--seconds", type=float, default=30.0, help="push time per N (whole 5 s cycles)")
    parser.add_argument("--processes", type=int, default=4, help="load generator processes")
    parser.add_argument("--push-interval", type=float, default=PUSH_INTERVAL, metavar="SECONDS",
                        help=f"each rank's push interval (default {PUSH_INTERVAL:g}, the hook's)")
    parser.add_argument("--pushgateway-arg", action="append", default=[], metavar="FLAG",
                        help="extra Pushgateway flag, e.g. --pushgateway-arg=--persistence.interval=1m")
    parser.add_argument("--no-consistency-check", action="store_true",
                        help="add --push.disable-consistency-check (faster, but one conflicting push "
                             "makes /metrics answer 500 for every group: not shipped)")
    parser.add_argument("--hook-client", action="store_true",
                        help="push through the hook's own client, counting the TCP connections it opens")
    args = parser.parse_args(argv)
    PUSH_INTERVAL = args.push_interval
    payload = hook_payload()
    shipped = ["--push.disable-consistency-check"] if args.no_consistency_check else []
    samples = sum(1 for line in payload.decode().splitlines() if line and not line.startswith("#"))
    print(f"hook payload: {len(payload)} bytes, {samples} samples per rank; push every {PUSH_INTERVAL:g} s, "
          f"Prometheus scrapes every {SCRAPE_INTERVAL}; Pushgateway flags: {shipped + args.pushgateway_arg or 'none'}; "
          f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    figures = []
    with tempfile.TemporaryDirectory() as scratch:
        for ranks in args.ranks:
            figures.append(run_load(ranks, args.seconds, args.processes, payload, Path(scratch) / str(ranks),
                                    shipped + args.pushgateway_arg, args.hook_client))
            print(f"N={ranks} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'':48}" + "".join(f"{'N=' + str(f['ranks']):>12}" for f in figures))
    for label, key, fmt, *scale in ROWS + (HOOK_CLIENT_ROWS if args.hook_client else []):
        print(f"{label:48}" + "".join(f"{fmt.format(f[key] * (scale[0] if scale else 1)):>12}" for f in figures))
    for f in figures:
        if f["head_series"] > 0:
            print(f"N={f['ranks']}: Prometheus RSS per million head series ~ "
                  f"{f['prom_rss_mib'] / f['head_series'] * 1e6 / 1024:.1f} GiB (includes its fixed ~30-50 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
