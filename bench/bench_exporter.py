"""Exporter benchmark: dualtrack's sampler + snapshot design next to a naive "call NVML per field on
every scrape" exporter (nvitop-exporter's call pattern), in one run, on the same simulated NVML:
8 H100s whose every NVML call costs 1 ms.

    .venv/bin/python bench/bench_exporter.py [--scrapes 300] [--window 10]

Reports scrape latency p50/p99, CPU per second while idle (the sampler's cost), CPU per scrape,
resident memory, NVML calls per GPU per sample (counted in the simulated NVML), and series per GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from stack.processes import free_port, wait_until  # noqa: E402

GPUS = 8
CALL_COST = 0.001
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the naive baseline ----------------------------------------------------------------------------
class NaiveCollector:
    """What nvitop-exporter does per GPU and refresh: 17 separate NVML calls, here on every scrape."""

    def __init__(self, lib) -> None:
        self.lib = lib
        lib.nvmlInit()
        self.handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(lib.nvmlDeviceGetCount())]

    def _readings(self, handle) -> dict[str, float]:
        lib = self.lib
        util = lib.nvmlDeviceGetUtilizationRates(handle)
        memory = lib.nvmlDeviceGetMemoryInfo(handle)
        out = {"gpu_utilization": util.gpu, "gpu_memory_utilization": util.memory, "gpu_memory_used": memory.used,
               "gpu_memory_total": memory.total, "gpu_memory_free": memory.free,
               "gpu_temperature": lib.nvmlDeviceGetTemperature(handle, lib.NVML_TEMPERATURE_GPU),
               "gpu_power_usage": lib.nvmlDeviceGetPowerUsage(handle),
               "gpu_power_limit": lib.nvmlDeviceGetEnforcedPowerLimit(handle),
               "gpu_pstate": lib.nvmlDeviceGetPerformanceState(handle),
               "gpu_pcie_tx": lib.nvmlDeviceGetPcieThroughput(handle, lib.NVML_PCIE_UTIL_TX_BYTES),
               "gpu_pcie_rx": lib.nvmlDeviceGetPcieThroughput(handle, lib.NVML_PCIE_UTIL_RX_BYTES),
               "gpu_processes": len(lib.nvmlDeviceGetComputeRunningProcesses(handle))}
        for name, clock in (("graphics", lib.NVML_CLOCK_GRAPHICS), ("sm", lib.NVML_CLOCK_SM),
                            ("memory", lib.NVML_CLOCK_MEM), ("video", lib.NVML_CLOCK_VIDEO)):
            out[f"gpu_clock_{name}"] = lib.nvmlDeviceGetClockInfo(handle, clock)
            out[f"gpu_clock_max_{name}"] = lib.nvmlDeviceGetMaxClockInfo(handle, clock)
        return out

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        families: dict[str, GaugeMetricFamily] = {}
        for index, handle in enumerate(self.handles):
            for name, value in self._readings(handle).items():
                families.setdefault(name, GaugeMetricFamily(name, name, labels=["index"])).add_metric([str(index)], value)
        yield from families.values()


def serve_naive(port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server
    from exporter.simulated import SimulatedNVML
    registry = CollectorRegistry()
    registry.register(NaiveCollector(SimulatedNVML("healthy", GPUS, call_cost=CALL_COST)))
    start_http_server(port, addr="127.0.0.1", registry=registry)
    while True:
        time.sleep(3600)


# --- measurements ----------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(name: str, argv: list[str], port: int) -> tuple[str, subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    wait_until(lambda: requests.get(url, timeout=2).status_code == 200 and "gpu" in requests.get(url, timeout=2).text,
               timeout=30, what=f"{name} serving")
    return name, proc, url


def scrape_latencies(session: requests.Session, url: str, count: int) -> tuple[list[float], int]:
    latencies = []
    size = 0
    for _ in range(count):
        started = time.perf_counter()
        response = session.get(url, timeout=30)
        latencies.append(time.perf_counter() - started)
        size = len(response.content)
    return latencies, size


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def in_process_sampling(samples: int = 60) -> dict[str, float]:
    """Ours, in this process over `samples` steady-state samples of 8 GPUs (no call cost): NVML calls
    per GPU per sample counted in the simulated NVML, and the sampler's own CPU time per sample
    (process CPU minus the CPU the simulation itself spent)."""
    from tests.exporter_support import Rig
    rig = Rig(gpus=GPUS)
    rig.step()
    first = sum(rig.lib.calls_by_gpu.values()) / GPUS
    per_sample = []
    cpu, simulated = time.process_time(), rig.lib.cpu_seconds
    for _ in range(samples):
        before = sum(rig.lib.calls_by_gpu.values())
        rig.step()
        per_sample.append((sum(rig.lib.calls_by_gpu.values()) - before) / GPUS)
    cpu, simulated = time.process_time() - cpu, rig.lib.cpu_seconds - simulated
    series = sum(len(v) for v in rig.sampler.store.current.samples[0].values.values()) + 1  # + nvml_gpu_info
    return {"average": statistics.mean(per_sample), "max": max(per_sample), "first": first, "series": series,
            "exporter_cpu": (cpu - simulated) / samples, "simulation_cpu": simulated / samples}


def naive_calls_per_gpu() -> tuple[float, int]:
    from exporter.simulated import SimulatedNVML
    lib = SimulatedNVML("healthy", GPUS)
    collector = NaiveCollector(lib)
    before = sum(lib.calls_by_gpu.values())
    families = list(collector.collect())
    return (sum(lib.calls_by_gpu.values()) - before) / GPUS, len(families)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--window", type=float, default=10.0, help="seconds of idle CPU measurement")
    parser.add_argument("--naive-server", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.naive_server:
        serve_naive(args.naive_server)
        return 0

    ports = [free_port() for _ in range(3)]
    ours = [sys.executable, "-m", "exporter", "--simulate=healthy", f"--simulate.gpus={GPUS}",
            f"--simulate.call-cost={CALL_COST}", "--log.level=error"]
    daemons = [
        start("dualtrack (1 s sampling)", ours + ["--sample-interval=1", f"--web.listen-address=127.0.0.1:{ports[0]}"],
              ports[0]),
        start("dualtrack, sampler idle", ours + ["--sample-interval=3600", f"--web.listen-address=127.0.0.1:{ports[1]}"],
              ports[1]),
        start("naive per-scrape", [sys.executable, __file__, f"--naive-server={ports[2]}"], ports[2]),
    ]
    try:
        time.sleep(3)  # let the samplers reach steady state (GPM, processes, clocks all sampled)
        idle_cpu = {name: cpu_seconds(proc.pid) for name, proc, _ in daemons}
        time.sleep(args.window)
        idle_cpu = {name: (cpu_seconds(proc.pid) - idle_cpu[name]) / args.window for name, proc, _ in daemons}
        results = {}
        session = requests.Session()
        for name, proc, url in (daemons[0], daemons[2]):
            scrape_latencies(session, url, 20)  # warm-up
            before = cpu_seconds(proc.pid)
            latencies, size = scrape_latencies(session, url, args.scrapes)
            results[name] = (latencies, (cpu_seconds(proc.pid) - before) / args.scrapes, size, rss_mb(proc.pid))
        bare = subprocess.run([sys.executable, "-c", "import prometheus_client, pynvml, pathlib; "
                               "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() "
                               "if l.startswith('VmRSS')][0].split()[1])"], capture_output=True, text=True)
        bare_mb = int(bare.stdout.strip()) / 1024
    finally:
        for _, proc, _ in daemons:
            proc.terminate()
            proc.wait(10)

    sampling = in_process_sampling()
    naive_calls, naive_series = naive_calls_per_gpu()
    sampler_cpu = idle_cpu[daemons[0][0]] - idle_cpu[daemons[1][0]]
    ours_name, naive_name = daemons[0][0], daemons[2][0]
    rows = [
        ("scrape latency p50 (ms)", f"{percentile(results[ours_name][0], 0.5) * 1e3:.1f}",
         f"{percentile(results[naive_name][0], 0.5) * 1e3:.1f}", ""),
        ("scrape latency p99 (ms)", f"{percentile(results[ours_name][0], 0.99) * 1e3:.1f}",
         f"{percentile(results[naive_name][0], 0.99) * 1e3:.1f}", "< 5"),
        ("CPU per scrape (ms)", f"{results[ours_name][1] * 1e3:.1f}", f"{results[naive_name][1] * 1e3:.1f}", ""),
        ("CPU while not scraped (% of a core)", f"{idle_cpu[ours_name] * 100:.2f}",
         f"{idle_cpu[naive_name] * 100:.2f}", ""),
        ("  of which sampler + simulated NVML (% of a core)", f"{sampler_cpu * 100:.2f}", "-", ""),
        ("sampler alone, 1 s interval (% of a core)", f"{sampling['exporter_cpu'] * 100:.2f}", "-", "<= 1"),
        ("  simulated NVML, 1 s interval (% of a core)", f"{sampling['simulation_cpu'] * 100:.2f}", "-", ""),
        ("resident memory (MB)", f"{results[ours_name][3]:.1f}", f"{results[naive_name][3]:.1f}", "< 40"),
        ("  bare python + prometheus_client + pynvml (MB)", f"{bare_mb:.1f}", f"{bare_mb:.1f}", ""),
        ("NVML calls per GPU per sample/scrape (avg)", f"{sampling['average']:.1f}", f"{naive_calls:.1f}", "<= 10"),
        ("NVML calls per GPU per sample (max; first sample)", f"{sampling['max']:.0f}; {sampling['first']:.0f}",
         f"{naive_calls:.0f}", ""),
        ("series per GPU", f"{sampling['series']}", f"{naive_series}", ""),
        ("exposition size (bytes, 8 GPUs)", f"{results[ours_name][2]}", f"{results[naive_name][2]}", ""),
    ]
    print(f"8 simulated H100s, every NVML call costs {CALL_COST * 1e3:.0f} ms; {args.scrapes} sequential scrapes; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    widths = [max(len(row[i]) for row in rows + [("", "dualtrack", "naive per-scrape", "target")]) for i in range(4)]
    for row in [("", "dualtrack", "naive per-scrape", "target")] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
