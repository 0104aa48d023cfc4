"""What users install works: run in a fresh virtual environment that holds the built wheel only.

Run by .ci/wheel with that environment's python, from a folder outside the tree and without
PYTHONPATH, so nothing here can come from the source tree. It checks, in order:
- every module of the installed packages imports from site-packages (integrations that need a
  framework raise an ImportError naming their extra);
- each console script and every `dualtrack` subcommand starts (`--help`);
- `dualtrack-exporter --simulate` serves simulated GPUs and stops cleanly on SIGTERM;
- the hook logs (no torch) and pushes to a real Pushgateway, and writes its record;
- `dualtrack janitor --once` reads that Pushgateway; `report` and `replay` take the record.
Exits non-zero (an AssertionError or a failed command) on the first thing that does not work.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()
BIN = Path(sys.executable).parent
PACKAGES = ("exporter", "trainer_hook", "dualtrack")


def run(*argv: str, timeout: float = 120) -> str:
    """Run a command; its output, or an AssertionError with the output when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    return result.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def wait_for(url: str, needle: str, proc: subprocess.Popen, timeout: float = 60) -> str:
    """The body of `url` once it contains `needle`; fails early when `proc` exits."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"{proc.args[0]} exited {proc.returncode} before serving {url}"
        try:
            body = fetch(url)
            if needle in body:
                return body
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} did not serve {needle!r} within {timeout:.0f} s"
        time.sleep(0.2)


def check_imports() -> None:
    count = 0
    for name in PACKAGES:
        package = importlib.import_module(name)
        assert SITE in Path(package.__file__).resolve().parents, f"{name} imported from {package.__file__}"
        for module in pkgutil.walk_packages(package.__path__, prefix=f"{name}."):
            if module.name.endswith(".__main__"):  # runs the command: checked below
                continue
            try:
                importlib.import_module(module.name)
            except ImportError as exc:  # a framework integration without its framework
                assert module.name.startswith("trainer_hook.integrations.") and "pip install" in str(exc), \
                    f"{module.name}: {exc!r}"
            count += 1
    assert "torch" not in sys.modules
    print(f"wheel: {count} modules import from {SITE}")


def check_commands() -> None:
    run(str(BIN / "dualtrack-exporter"), "--help")
    usage = run(str(BIN / "dualtrack"), "--help")
    subcommands = re.findall(r"^    (\w+) ", usage, re.M)
    assert {"janitor", "replay", "report"} <= set(subcommands), usage
    for subcommand in subcommands:
        run(str(BIN / "dualtrack"), subcommand, "--help")
    print(f"wheel: dualtrack-exporter and dualtrack {', '.join(subcommands)} start")


def check_exporter() -> None:
    port = free_port()
    exporter = subprocess.Popen([str(BIN / "dualtrack-exporter"), "--simulate=healthy,input-bound",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        body = wait_for(f"http://127.0.0.1:{port}/metrics", "nvml_gpu_info{", exporter)
        gpus = {line.split('uuid="')[1].split('"')[0] for line in body.splitlines()
                if line.startswith("nvml_gpu_info{")}
        assert len(gpus) == 2, body
    finally:
        exporter.send_signal(signal.SIGTERM)
        output, _ = exporter.communicate(timeout=30)
    assert exporter.returncode == 0, f"dualtrack-exporter exited {exporter.returncode} on SIGTERM:\n{output}"
    print(f"wheel: dualtrack-exporter served {len(gpus)} simulated GPUs and stopped on SIGTERM")


def check_hook_and_tools(tmp: Path) -> None:
    from trainer_hook import TrainingMonitor

    port = free_port()
    gateway = subprocess.Popen(["prometheus-pushgateway", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    records = tmp / "records"
    try:
        wait_for(f"{url}/-/ready", "", gateway)
        with TrainingMonitor(job="wheel", run="smoke", pushgateway=url, push_interval=0.2,
                             record_path=records / "wheel-smoke-rank0.jsonl", delete_after=None) as monitor:
            for step in range(30):
                monitor.log({"loss": float("nan") if step == 20 else 1.0 / (step + 1)}, step=step, samples=8)
            wait_for(f"{url}/metrics", 'training_first_nonfinite_step{', gateway)
        pushed = fetch(f"{url}/metrics")
        assert 'run="smoke"' in pushed and 'training_run_state{' in pushed, pushed
        print("wheel: the hook logged 30 steps without torch and pushed them")
        run(str(BIN / "dualtrack"), "janitor", "--once", f"--pushgateway={url}")
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    report = tmp / "report.html"
    run(str(BIN / "dualtrack"), "report", str(records), "--out", str(report))
    assert "<svg" in report.read_text(), "the report has no figure"
    run(str(BIN / "dualtrack"), "replay", str(records), "--out", str(tmp / "blocks"), timeout=300)
    blocks = [path for path in (tmp / "blocks").iterdir() if (path / "meta.json").exists()]
    assert blocks, "replay wrote no TSDB block"
    print(f"wheel: janitor ran; report wrote {report.stat().st_size // 1024} KiB; replay wrote {len(blocks)} block(s)")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # nothing importable from the tree
        check_imports()
        check_commands()
        check_exporter()
        check_hook_and_tools(Path(tmp))


if __name__ == "__main__":
    main()
