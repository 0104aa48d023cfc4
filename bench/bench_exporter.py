"""Exporter benchmark: dualtrack's sampler + snapshot design next to nvitop-exporter, in one run, on the
same simulated NVML: 8 H100s whose every NVML call costs 1 ms.

    .venv/bin/python bench/bench_exporter.py [--scrapes 300] [--window 10] [--nvitop-python PATH]

The baseline is the real nvitop-exporter (its own code, on the simulated NVML through
bench/nvitop_simulated.py), run by `--nvitop-python`: a Python that has nvitop-exporter installed,
in a virtual environment of its own (it is no dependency of dualtrack):

    python3 -m venv /tmp/venv-nvitop && /tmp/venv-nvitop/bin/pip install nvitop-exporter==1.7.2

Without it (or when that Python cannot import nvitop_exporter) the baseline is a stand-in, labelled
"naive": nvitop-exporter's 17 NVML calls per GPU, made on every scrape.

Reports scrape latency p50/p99 (as Prometheus scrapes: keep-alive, gzip), CPU per second while idle
(the sampler's cost), CPU per scrape, CPU at one scrape per 15 s (idle CPU + CPU per scrape / 15, ours
with the CPU of a scrape without reuse), resident memory, NVML calls per GPU per sample (counted in the
simulated NVML), series per GPU, and the ratios dualtrack / baseline.
CPU is counted in clock ticks (10 ms) over `--window` seconds: 10 s gives about +-0.1 % of a core,
30 s (the README's figures) +-0.03 %. The daemons run at once, so their samplers' phases relative to
one another (set by when each started) also move the idle figures by a few hundredths of a percent.
The "no reuse" column is the same daemon with the same flags rendering every scrape anew
(`exporter.exposition.REUSE_SECONDS = 0`): what a scrape costs when it finds no body rendered for
its snapshot and format (at one scrape per 15 s, every scrape); its scrapes alternate with the others'.
Both exporters run as installed: dualtrack from a copy of `exporter/` in a temporary directory whose bytecode
is compiled first (pip compiles an installed package's; a checkout run with PYTHONDONTWRITEBYTECODE
would compile every module at each start, which costs resident memory), nvitop-exporter from its
virtual environment, each on that copy's simulated NVML.
"""
from __future__ import annotations

import argparse
import compileall
import gzip
import http.client
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from stack.processes import free_port, wait_until

GPUS = 8
CALL_COST = 0.001
SCRAPE_INTERVAL = 15.0  # seconds: Prometheus' usual scrape interval, for the "CPU at 15 s scrapes" row
NVITOP_LAUNCHER = REPO / "bench" / "nvitop_simulated.py"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the naive stand-in: the baseline where nvitop-exporter is not installed --------------------------
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
                family = families.setdefault(name, GaugeMetricFamily(name, name, labels=["index"]))
                family.add_metric([str(index)], value)
        yield from families.values()


NO_REUSE = ("import sys, exporter.cli, exporter.exposition; exporter.exposition.REUSE_SECONDS = 0; "
            "sys.exit(exporter.cli.main(sys.argv[1:]))")


def installed_copy(directory: str) -> str:
    """`directory` with a copy of `exporter/` whose bytecode is compiled, as pip installs a package."""
    shutil.copytree(REPO / "exporter", Path(directory) / "exporter", ignore=shutil.ignore_patterns("__pycache__"))
    if not compileall.compile_dir(Path(directory) / "exporter", quiet=1):
        sys.exit("bench_exporter: cannot compile the exporter's bytecode")
    return directory


def serve_naive(port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    from exporter.simulated import SimulatedNVML
    registry = CollectorRegistry()
    lib = SimulatedNVML("healthy", GPUS, call_cost=CALL_COST)
    lib.nvmlInit()
    registry.register(NaiveCollector(lib))
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


def start(name: str, argv: list[str], port: int, installed: str) -> tuple[str, subprocess.Popen, str]:
    """Start a daemon whose `exporter` package is the compiled copy in `installed`."""
    env = {**os.environ, "PYTHONPATH": installed}
    proc = subprocess.Popen(argv, cwd=installed, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    wait_until(lambda: requests.get(url, timeout=2).status_code == 200 and "gpu" in requests.get(url, timeout=2).text,
               timeout=30, what=f"{name} serving")
    return name, proc, url


OPENMETRICS = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75," \
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"  # Prometheus 2's scrape Accept header


class Scraper:
    """Scrapes as Prometheus does: one kept-alive connection per target (re-opened when the server closes
    it), Accept-Encoding gzip, the body read but not decompressed. http.client rather than requests,
    whose own ~2 ms per request on this VM would be added to every daemon's latency alike."""

    def __init__(self, urls: list[str]) -> None:
        self.targets = [(http.client.HTTPConnection(parts.hostname, parts.port, timeout=30), parts.path)
                        for parts in map(urlsplit, urls)]

    def latencies(self, count: int, accept: str = "*/*") -> list[tuple[list[float], int]]:
        """`count` scrapes of every target, alternating between them: (latencies, body size) per target."""
        results: list[tuple[list[float], int]] = [([], 0) for _ in self.targets]
        for _ in range(count):
            for i, (connection, path) in enumerate(self.targets):
                started = time.perf_counter()
                connection.request("GET", path, headers={"Accept": accept, "Accept-Encoding": "gzip"})
                response = connection.getresponse()
                body = response.read()
                results[i][0].append(time.perf_counter() - started)
                gzipped = response.getheader("Content-Encoding") == "gzip"
                results[i] = (results[i][0], len(gzip.decompress(body) if gzipped else body))
        return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def in_process_sampling(samples: int = 60) -> dict[str, float]:
    """Ours, in this process over `samples` steady-state samples of 8 GPUs (no call cost): NVML calls
    per GPU per sample counted in the simulated NVML (every call, those without a device argument too),
    and the sampler's own CPU time per sample (process CPU minus the CPU the simulation itself spent)."""
    from tests.support.exporter import Rig
    rig = Rig(gpus=GPUS)
    rig.step()
    calls = lambda: sum(rig.lib.calls.values()) - rig.lib.calls["nvmlInit"]  # noqa: E731
    first = calls() / GPUS
    per_sample = []
    cpu, simulated = time.process_time(), rig.lib.cpu_seconds
    for _ in range(samples):
        before = calls()
        rig.step()
        per_sample.append((calls() - before) / GPUS)
    cpu, simulated = time.process_time() - cpu, rig.lib.cpu_seconds - simulated
    series = sum(len(v) for v in rig.sampler.store.current.samples[0].values.values()) + 1  # + nvml_gpu_info
    return {"average": statistics.mean(per_sample), "max": max(per_sample), "first": first, "series": series,
            "exporter_cpu": (cpu - simulated) / samples, "simulation_cpu": simulated / samples}


def naive_calls_per_gpu() -> float:
    from tests.support.nvml_faults import FaultyNVML  # counts the calls it answers
    lib = FaultyNVML("healthy", GPUS)
    lib.nvmlInit()
    collector = NaiveCollector(lib)
    before = sum(lib.calls_by_gpu.values())
    list(collector.collect())
    return (sum(lib.calls_by_gpu.values()) - before) / GPUS


def daemon_flags(port: int, interval: float) -> list[str]:
    return ["--simulate=healthy", f"--simulate.gpus={GPUS}", f"--simulate.call-cost={CALL_COST}", "--log.level=error",
            f"--sample-interval={interval:g}", f"--web.listen-address=127.0.0.1:{port}"]


def nvitop_python(requested: str | None) -> str | None:
    """The Python that runs nvitop-exporter: `requested`, else this one; None if it cannot import it."""
    python = requested or sys.executable
    check = subprocess.run([python, "-c", "import nvitop_exporter"], capture_output=True)
    if check.returncode == 0:
        return python
    if requested:
        sys.exit(f"bench_exporter: {requested} cannot import nvitop_exporter")
    return None


def nvitop_version(python: str) -> str:
    return subprocess.run([python, "-c", "from importlib.metadata import version; print(version('nvitop-exporter'))"],
                          capture_output=True, text=True).stdout.strip()


def nvitop_calls_per_gpu(python: str) -> float:
    """nvitop-exporter's NVML calls per GPU per refresh, counted in the simulated NVML."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([python, str(NVITOP_LAUNCHER), f"--gpus={GPUS}", "--count=20"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def baseline_daemon(python: str | None, port: int) -> tuple[str, list[str]]:
    """(column name, argv) of the baseline: the real nvitop-exporter, or the naive stand-in."""
    if python is None:
        return "naive stand-in (NVML per scrape)", [sys.executable, __file__, f"--naive-server={port}"]
    return (f"nvitop-exporter {nvitop_version(python)}",
            [python, str(NVITOP_LAUNCHER), f"--gpus={GPUS}", f"--call-cost={CALL_COST}", "--",
             f"--port={port}", "--bind-address=127.0.0.1", "--interval=1"])


def series_per_gpu(body: bytes) -> int:
    """Sample lines of GPU 0 in an exposition (gpu="0" for dualtrack, index="0" for nvitop-exporter)."""
    return sum(1 for line in body.decode().splitlines()
               if not line.startswith("#") and ('gpu="0"' in line or 'index="0"' in line))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--window", type=float, default=10.0, help="seconds of idle CPU measurement")
    parser.add_argument("--nvitop-python", help="a Python with nvitop-exporter installed (default: this one, "
                                                "if it has it; else the naive stand-in)")
    parser.add_argument("--naive-server", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.naive_server:
        serve_naive(args.naive_server)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-exporter-") as directory:
        return measure(args, installed_copy(directory))


def measure(args: argparse.Namespace, installed: str) -> int:
    python = nvitop_python(args.nvitop_python)
    ports = [free_port() for _ in range(4)]
    ours = [sys.executable, "-m", "exporter"]
    base_name, base_argv = baseline_daemon(python, ports[3])
    daemons = [
        start("(reusing bodies)", ours + daemon_flags(ports[0], 1), ports[0], installed),
        start("no reuse", [sys.executable, "-c", NO_REUSE, *daemon_flags(ports[1], 1)], ports[1], installed),
        start("dualtrack, sampler idle", ours + daemon_flags(ports[2], 3600), ports[2], installed),
        start(base_name, base_argv, ports[3], installed),
    ]
    (fast, fast_proc, fast_url), (no_reuse, no_reuse_proc, no_reuse_url) = daemons[0], daemons[1]
    idle_name, (base, base_proc, base_url) = daemons[2][0], daemons[3]
    try:
        time.sleep(3)  # let the samplers reach steady state (GPM, processes, clocks all sampled)
        idle_cpu = {name: cpu_seconds(proc.pid) for name, proc, _ in daemons}
        time.sleep(args.window)
        idle_cpu = {name: (cpu_seconds(proc.pid) - idle_cpu[name]) / args.window for name, proc, _ in daemons}
        ours_urls, ours_procs = [fast_url, no_reuse_url], [fast_proc, no_reuse_proc]
        scraper = Scraper(ours_urls + [base_url])
        scraper.latencies(20)  # warm-up
        # every daemon's scrapes alternate, so that load on the machine falls on all alike
        all_procs = ours_procs + [base_proc]
        before = [cpu_seconds(proc.pid) for proc in all_procs]
        started = time.monotonic()
        text = dict(zip((fast, no_reuse, base), scraper.latencies(args.scrapes)))
        elapsed = time.monotonic() - started
        # CPU per scrape: CPU over the scrapes minus what the daemon spends anyway (its idle rate)
        cpu_per_scrape = {name: (cpu_seconds(proc.pid) - start_cpu - idle_cpu[name] * elapsed) / args.scrapes
                          for name, proc, start_cpu in zip((fast, no_reuse, base), all_procs, before)}
        om = dict(zip((fast, no_reuse), Scraper(ours_urls).latencies(args.scrapes, OPENMETRICS)))
        base_body = requests.get(base_url, timeout=30).content
        rss = {name: rss_mb(proc.pid) for name, proc, _ in daemons}
        bare = subprocess.run([sys.executable, "-c", "import pynvml, pathlib; "
                               "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() "
                               "if l.startswith('VmRSS')][0].split()[1])"], capture_output=True, text=True)
        bare_mb = int(bare.stdout.strip()) / 1024
    finally:
        for _, proc, _ in daemons:
            proc.terminate()
            proc.wait(10)

    sampling = {fast: in_process_sampling()}
    sampling[no_reuse] = sampling[fast]  # the same sampler
    base_calls = nvitop_calls_per_gpu(python) if python else naive_calls_per_gpu()
    sampler_cpu = {name: idle_cpu[name] - idle_cpu[idle_name] for name in (fast, no_reuse)}
    # one scrape per 15 s never finds a body rendered for its snapshot: ours pays the no-reuse scrape
    at_15s = {name: idle_cpu[name] + cpu_per_scrape[no_reuse if name == fast else name] / SCRAPE_INTERVAL
              for name in (fast, no_reuse, base)}

    def ms(latencies: list[float], q: float) -> str:
        return f"{percentile(latencies, q) * 1e3:.1f}"

    def ratio(ours_value: float, base_value: float) -> str:
        return f"{ours_value / base_value:.2f}x" if base_value else "-"

    rows = [
        ("scrape latency p50, text 0.0.4 (ms)", ms(text[fast][0], 0.5), ms(text[no_reuse][0], 0.5),
         ms(text[base][0], 0.5), ratio(percentile(text[fast][0], 0.5), percentile(text[base][0], 0.5)), ""),
        ("scrape latency p99, text 0.0.4 (ms)", ms(text[fast][0], 0.99), ms(text[no_reuse][0], 0.99),
         ms(text[base][0], 0.99), ratio(percentile(text[fast][0], 0.99), percentile(text[base][0], 0.99)),
         "<= 0.25x"),
        ("  p99 without reuse / baseline", "", "", "",
         ratio(percentile(text[no_reuse][0], 0.99), percentile(text[base][0], 0.99)), ""),
        ("scrape latency p50, OpenMetrics (ms)", ms(om[fast][0], 0.5), ms(om[no_reuse][0], 0.5), "-", "", ""),
        ("scrape latency p99, OpenMetrics (ms)", ms(om[fast][0], 0.99), ms(om[no_reuse][0], 0.99), "-", "", ""),
        ("CPU per scrape, text (ms)", *(f"{cpu_per_scrape[name] * 1e3:.1f}" for name in (fast, no_reuse, base)),
         ratio(cpu_per_scrape[fast], cpu_per_scrape[base]), ""),
        ("  CPU per scrape without reuse / baseline", "", "", "", ratio(cpu_per_scrape[no_reuse], cpu_per_scrape[base]),
         ""),
        ("CPU while not scraped (% of a core)", *(f"{idle_cpu[name] * 100:.2f}" for name in (fast, no_reuse, base)),
         ratio(idle_cpu[fast], idle_cpu[base]), ""),
        ("CPU at one scrape per 15 s (% of a core)", *(f"{at_15s[name] * 100:.2f}" for name in (fast, no_reuse, base)),
         ratio(at_15s[fast], at_15s[base]), "<= 0.35x"),
        ("  of which sampler + simulated NVML (% of a core)", f"{sampler_cpu[fast] * 100:.2f}",
         f"{sampler_cpu[no_reuse] * 100:.2f}", "-", "", ""),
        ("  of which the rest: XID watcher, main loop (% of a core)", *[f"{idle_cpu[idle_name] * 100:.2f}"] * 2,
         "-", "", ""),
        ("sampler alone, 1 s interval (% of a core)", f"{sampling[fast]['exporter_cpu'] * 100:.2f}",
         f"{sampling[no_reuse]['exporter_cpu'] * 100:.2f}", "-", "", "<= 1"),
        ("  simulated NVML, 1 s interval (% of a core)", f"{sampling[fast]['simulation_cpu'] * 100:.2f}",
         f"{sampling[no_reuse]['simulation_cpu'] * 100:.2f}", "-", "", ""),
        ("resident memory (MB)", *(f"{rss[name]:.1f}" for name in (fast, no_reuse, base)), ratio(rss[fast], rss[base]),
         "<= 0.9x"),
        ("  bare python + pynvml (MB)", *[f"{bare_mb:.1f}"] * 3, "", ""),
        ("NVML calls per GPU per sample (avg)", f"{sampling[fast]['average']:.1f}",
         f"{sampling[no_reuse]['average']:.1f}", f"{base_calls:.1f}", ratio(sampling[fast]["average"], base_calls),
         "<= 5"),
        ("NVML calls per GPU per sample (max; first sample)",
         f"{sampling[fast]['max']:.0f}; {sampling[fast]['first']:.0f}",
         f"{sampling[no_reuse]['max']:.0f}; {sampling[no_reuse]['first']:.0f}", "-", "", ""),
        ("series per GPU", f"{sampling[fast]['series']}", f"{sampling[no_reuse]['series']}",
         f"{series_per_gpu(base_body)}", "", ""),
        ("exposition size (bytes, 8 GPUs; text)", *(f"{text[name][1]}" for name in (fast, no_reuse, base)), "", ""),
    ]
    print(f"8 simulated H100s, every NVML call costs {CALL_COST * 1e3:.0f} ms; {args.scrapes} sequential scrapes "
          f"per format (all daemons alternating); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    header = ("", "dualtrack " + fast, "dualtrack " + no_reuse, base, "dualtrack / baseline", "target")
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
