"""Post-mortem tools benchmark (`.venv/bin/python bench/bench_replay.py`).

1. `dualtrack replay` of a synthetic 1,000,000-step record (10 steps/s, ~28 h, 4 logged keys plus
   data wait): wall time, peak RSS of the Python process and of promtool, samples and block size;
   the same for 100,000 steps, to show that memory does not grow with the record (it streams).
2. `dualtrack report` of a 100,000-step record: wall time and HTML size.
Each command runs in a fresh process, as a user would run it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Runs a dualtrack subcommand in-process; prints its RSS once the modules are imported (no torch:
#: trainer_hook.contract only) and its peak RSS at the end (KiB).
RUNNER = ("import resource, sys; import dualtrack.openmetrics, dualtrack.report, dualtrack.summary; "
          "base = int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]); "
          "from dualtrack.cli import main; code = main(sys.argv[1:]); "
          "print('PEAK', base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)")


def make_record(path: Path, steps: int) -> int:
    """A format-2 record of `steps` steps with a NaN streak at 60 %; returns its size in bytes."""
    start = 1_790_000_000.0
    with open(path, "w") as out:
        out.write(json.dumps({"event": "start", "format": 2, "time": start, "job": "bench", "run": f"r{steps}",
                              "rank": 0, "local_rank": 0, "world_size": 1, "instance": "node1", "pid": 1,
                              "config": {"lr": "0.0003", "batch_size": "256"}}) + "\n")
        nan_from = int(steps * 0.6)
        for n in range(steps):
            loss = "nan" if nan_from <= n < nan_from + 3 else 2.0 / (1 + n / 10_000) + (n % 17) * 1e-3
            line = {"time": round(start + n * 0.1, 6), "step": n, "batch_id": n, "samples": 256, "tokens": None,
                    "duration_seconds": 0.1, "data_wait_seconds": 0.004 + (n % 7) * 1e-3,
                    "values": {"loss": loss, "grad_norm": 1.0 + (n % 13) * 0.05, "learning_rate": 3e-4,
                               "epoch": n // 50_000}}
            if loss == "nan":
                line["nonfinite"] = ["loss"]
            out.write(json.dumps(line) + "\n")
        out.write(json.dumps({"event": "end", "time": start + steps * 0.1, "state": "finished", "steps": steps}) + "\n")
    return path.stat().st_size


def run_cli(args: list[str]) -> tuple[float, int, int, int, str]:
    """(seconds, RSS after imports, peak RSS, promtool's peak RSS (KiB), first output line) of one command."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", RUNNER, *args], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    promtool_peak = 0
    while process.poll() is None:
        promtool_peak = max(promtool_peak, child_peak_rss(process.pid, "promtool"))
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"dualtrack {' '.join(args)} failed: {stderr.strip()}")
    peak = next(line for line in stdout.splitlines() if line.startswith("PEAK")).split()
    return elapsed, int(peak[1]), int(peak[2]), promtool_peak, stdout.splitlines()[0]


def child_peak_rss(parent: int, name: str) -> int:
    """The largest VmHWM (KiB) among the running children of `parent` called `name`."""
    peak = 0
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return 0
    for pid in children:
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        if fields.get("Name", "").strip() == name:
            peak = max(peak, int(fields.get("VmHWM", "0 kB").split()[0]))
    return peak


def directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k and 10k steps instead of 1M and 100k")
    args = parser.parse_args()
    big, small = (100_000, 10_000) if args.quick else (1_000_000, 100_000)
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as work:
        work = Path(work)
        for steps in (small, big):
            record = work / f"bench-r{steps}-rank0.jsonl"
            size = make_record(record, steps)
            out = work / f"blocks-{steps}"
            seconds, base, own, promtool, summary = run_cli(["replay", str(record), "--out", str(out)])
            print(f"replay {steps:>9,} steps ({size / 2**20:.0f} MiB record): {seconds:6.1f} s "
                  f"({steps / seconds:,.0f} steps/s), peak RSS python {own / 1024:.0f} MiB "
                  f"({base / 1024:.0f} MiB after imports), promtool {promtool / 1024:.0f} MiB, "
                  f"blocks {directory_size(out) / 2**20:.0f} MiB")
            print(f"    {summary}")
        record = work / f"bench-r{small}-rank0.jsonl"
        page = work / "report.html"
        seconds, _, own, _, _ = run_cli(["report", str(record), "--out", str(page)])
        print(f"report {small:>9,} steps: {seconds:6.1f} s, HTML {page.stat().st_size / 1024:.0f} KiB, "
              f"peak RSS {own / 1024:.0f} MiB")
        seconds, _, own, _, _ = run_cli(["report", str(work / f"bench-r{big}-rank0.jsonl"), "--out", str(page)])
        print(f"report {big:>9,} steps: {seconds:6.1f} s, HTML {page.stat().st_size / 1024:.0f} KiB, "
              f"peak RSS {own / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
