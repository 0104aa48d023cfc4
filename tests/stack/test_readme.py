"""The README's promises, checked against what the code does: its hook snippet runs as written, and
it states the demo's alert times the demo announces."""
from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from stack import processes
from stack.demo import DEFAULT_PORTS
from tests.support import daemons
from tests.support.hook import live_stack, pushed_value, run_id
from tests.support.paths import REPO
from trainer_hook import TrainingMonitor

README = REPO / "README.md"
DASHBOARDS_DOC = REPO / "docs" / "dashboards.md"

# What the snippet leaves to the reader ("model, optimizer and train_loader are your own").
USER_CODE = """
import torch
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
train_loader = [torch.randn(256, 8) for _ in range(5)]
"""


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_hook_snippet_runs_as_written_without_a_warning(start_service, tmp_path) -> None:
    """With or without CUDA: run under `-W error`, it trains and its steps reach the Pushgateway."""
    snippet = next(block for block in python_blocks(README.read_text()) if "TrainingMonitor(job=" in block)
    pgw = start_service(processes.pushgateway(tmp_path))
    run = run_id("readme")
    script = tmp_path / "snippet.py"
    script.write_text(USER_CODE + snippet.replace("http://127.0.0.1:9091", pgw.url))
    env = {**os.environ, "PYTHONPATH": str(REPO), "DUALTRACK_RUN": run, "DUALTRACK_DELETE_AFTER": "none"}
    done = subprocess.run([sys.executable, "-W", "error", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert pushed_value(pgw.url, "training_steps_total", run, job="pretrain") == 5


def announced_minutes(text: str, names: list[str]) -> dict[str, int]:
    """For each alert name, the first "about N min" after its first mention in `text`."""
    text = " ".join(text.split())
    found = {}
    for name in names:
        match = re.search(re.escape(name) + r".*?about (\d+) min", text)
        assert match, f"no time given for {name}"
        found[name] = int(match.group(1))
    return found


def test_readme_banner_and_docs_give_the_demo_alert_times_counted_from_up(capsys) -> None:
    """One source (stack.demo.alert_times): the banner prints it, README and docs state the same
    minutes, all counted from the "dualtrack is up" line."""
    from stack.demo import EXPLODE_AFTER, alert_times, parse_args, print_expectations
    expected = {name: round(seconds / 60) for name, seconds in alert_times(EXPLODE_AFTER).items()}
    print_expectations(parse_args([]), real_gpus=False)
    banner = capsys.readouterr().out
    assert 'timed from "dualtrack is up"' in banner
    assert announced_minutes(banner, list(expected)) == expected
    readme = README.read_text()
    paragraph = next(p for p in readme.split("\n\n") if "TrainingDataLoaderBottleneck" in p and "about" in p)
    assert "count from the `dualtrack is up` line" in " ".join(paragraph.split())
    assert announced_minutes(paragraph, list(expected)) == expected
    docs = " ".join(DASHBOARDS_DOC.read_text().split())
    assert f"in the demo it prints about {expected['GPUMemoryLeakSuspected']} min after its leak starts" in docs


HOOK_DOC = REPO / "docs" / "hook.md"
PERFORMANCE_DOC = REPO / "docs" / "performance.md"


def test_the_hook_doc_quotes_the_readmes_log_cost_and_installs_without_placeholders() -> None:
    """docs/hook.md's log() figures are docs/performance.md's table's, its install commands run
    as written (no `<... URL>` placeholder), and both pin the torch version the tests run with."""
    readme, hook = README.read_text(), " ".join(HOOK_DOC.read_text().split())
    figures = PERFORMANCE_DOC.read_text()
    floats = re.search(r"^\| 3 floats \| ([\d.]+) µs \|", figures, re.M).group(1)
    tensors = re.search(r"^\| 30 CPU 0-d tensors \| ([\d.]+) µs \|", figures, re.M).group(1)
    assert f"{floats} µs for 3 Python floats, {tensors} µs for 30 CPU 0-d tensors" in hook
    assert not re.search(r"<[^>]*(URL|url)[^>]*>", HOOK_DOC.read_text())
    tested = re.search(r'pip_install "torch==([\d.]+)"', (REPO / "scripts" / "setup").read_text()).group(1)
    assert f"is tested with torch {tested} and without torch" in " ".join(readme.split())
    for text in (readme, hook):
        assert f"pip install 'torch=={tested}' '" in text


def test_the_layout_table_names_every_module() -> None:
    """Each package's row of the README's layout table names each of its modules (a sub-package by
    its folder), so a new module cannot go unmentioned."""
    rows = {match[1]: match[2] for match in re.finditer(r"^\| `(\w+)/` \| (.*) \|$", README.read_text(), re.M)}
    missing = []
    for package in ("exporter", "trainer_hook", "dualtrack", "stack"):
        row = rows[package]
        for path in sorted((REPO / package).iterdir()):
            if path.suffix == ".py" and path.stem not in ("__init__", "__main__"):
                named = f"`{path.name}`" in row
            elif (path / "__init__.py").is_file():
                named = f"`{path.name}/`" in row
            else:
                continue
            if not named:
                missing.append(f"{package}/{path.name}")
    assert missing == [], "not in the README's layout table"


def test_the_supported_versions_are_pyprojects_floors() -> None:
    """The README's "Supported versions" names Python's floor and every dependency's, as declared."""
    project = (REPO / "pyproject.toml").read_text()
    supported = re.search(r"^Supported versions: (.*?)\.\s", README.read_text(), re.M | re.S).group(1)
    python = re.search(r'^requires-python = ">=([\d.]+)"$', project, re.M).group(1)
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", project, re.M | re.S).group(1)
    floors = re.findall(r'^    "([\w-]+)>=([\w.]+)"', dependencies, re.M)
    assert floors and f"Python >= {python}," in supported
    for name, floor in floors:
        assert f"`{name} >= {floor}`" in supported.replace("\n", " "), (name, floor)
    assert f"on Python {python}" in README.read_text()


def sh_commands(text: str) -> list[str]:
    """The command lines of the ```sh blocks in `text` (comments after them dropped)."""
    return [line.split("  #")[0].strip() for block in re.findall(r"```sh\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_two_commands_are_two_and_the_second_runs_as_printed(start_service, tmp_path) -> None:
    """The first screen: `bash scripts/up`, then the dualtrack command as it exists in the clone
    (.venv/bin/dualtrack), run as printed (only Prometheus' address differs) on a live run named as
    the demo's exploding run: it names the run's non-finite event."""
    readme = README.read_text()
    heading = next(line for line in readme.splitlines() if line.startswith("## ") and "two commands" in line)
    section = readme.split(heading, 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    first, second = sh_commands(f"```sh\n{block}```")
    assert first == "bash scripts/up" and second.startswith(".venv/bin/dualtrack explain explode-lr3e-2 ")
    url = re.search(r"--prometheus (\S+)", second).group(1)
    assert url == f"http://127.0.0.1:{DEFAULT_PORTS['prometheus']}"
    pgw, _, prometheus = live_stack(tmp_path, start_service, "--simulate=healthy", "--simulate.gpus=1")
    with TrainingMonitor(job="demo", run="explode-lr3e-2", pushgateway=pgw.url, push_interval=0.2,
                         record_path=False, delete_after=None) as monitor:
        step = 0

        def train() -> list[dict]:
            nonlocal step
            step += 1
            monitor.log({"loss": math.nan if step > 3 else 1.0}, step=step)
            return daemons.query(prometheus.url, 'training_first_nonfinite_step{run="explode-lr3e-2"} >= 0')

        processes.wait_until(train, 60, interval=0.2, what="the run's non-finite step in Prometheus")
    argv = shlex.split(second.replace(url, prometheus.url))
    program = REPO / argv[0]
    if not program.is_file():  # the tests run from elsewhere than the clone's .venv (an installed wheel)
        pytest.skip(f"{argv[0]} is not here")
    done = subprocess.run([str(program), *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={key: value for key, value in os.environ.items() if key != "DUALTRACK_PROMETHEUS"})
    assert done.returncode == 0, done.stderr
    assert "nonfinite: step 4" in done.stdout, done.stdout


def test_every_dualtrack_command_the_readme_prints_parses_and_replay_help_agrees() -> None:
    """Each `dualtrack` line of the README's sh blocks calls the clone's .venv/bin/dualtrack with a
    subcommand and flags that exist; `replay --help` names the same way to load its blocks."""
    from dualtrack.cli import build_parser
    readme = README.read_text()
    printed = [line for line in sh_commands(readme) if shlex.split(line)[0].endswith("dualtrack")]
    assert printed, "no dualtrack command in the README"
    for line in printed:
        argv = shlex.split(line)
        assert argv[0] == ".venv/bin/dualtrack", line
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"the README's `{line}` does not parse")
    load = re.search(r"^(bash scripts/up --replay) \S+", readme, re.M).group(1)
    help_text = " ".join(subprocess.run([sys.executable, "-m", "dualtrack", "replay", "--help"], cwd=REPO,
                                        capture_output=True, text=True, timeout=60).stdout.split())
    assert f"`{load} DIR`" in help_text and "python -m stack" not in help_text
