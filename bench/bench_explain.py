"""`dualtrack explain` benchmark (`.venv/bin/python bench/bench_explain.py`).

A 24 h, 64-rank run (one GPU per rank, both tracks, sampled every 60 s by default) is backfilled
into a real Prometheus with promtool; its last rank's GPU reports an XID 79, then that rank goes
non-finite and fails (tests/support/explain.py's "xid" scenario). `dualtrack explain --json` runs in
a fresh process, as a user runs it: wall time, peak RSS, the events found and the queries'
Prometheus time. Prints one JSON object.
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
sys.path.insert(0, str(REPO))

from stack import processes
from tests.support import explain as explain_support

RUNNER = ("import resource, sys; from dualtrack.cli import main; code = main(sys.argv[1:]); "
          "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--scrape", type=float, default=60.0, help="seconds between samples (default 60)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-explain-") as tmp:
        work = Path(tmp)
        base = (time.time() // 3600 - args.hours - 2) * 3600
        started = time.perf_counter()
        samples = explain_support.backfill({"bench": "xid"}, base, work / "prometheus-data", work,
                                           ranks=args.ranks, minutes=args.hours * 60, scrape=args.scrape)
        backfill_s = time.perf_counter() - started
        config = work / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1h}\n")
        prometheus = processes.prometheus(work, config).start(timeout=300)
        try:
            command = [sys.executable, "-c", RUNNER, "explain", "bench", "--prometheus", prometheus.url,
                       "--since", str(base), "--until", str(base + args.hours * 3600 + 120), "--json"]
            runs = []
            for _ in range(2):  # the second run reads what the first brought into Prometheus' page cache
                started = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                                      env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
                runs.append(time.perf_counter() - started)
                if done.returncode != 0:
                    print(done.stderr, file=sys.stderr)
                    return 1
            peak_kib = int(done.stderr.split("PEAK")[1].split()[0])
            found = json.loads(done.stdout)
        finally:
            prometheus.stop()
    print(json.dumps({"ranks": args.ranks, "hours": args.hours, "scrape_s": args.scrape, "samples": samples,
                      "backfill_s": round(backfill_s, 1), "explain_wall_s": [round(r, 2) for r in runs],
                      "explain_peak_rss_mib": round(peak_kib / 1024, 1),
                      "events": [(e["kind"], e["rank"], [c["kind"] for c in e["causes"]]) for e in found["events"]]},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
