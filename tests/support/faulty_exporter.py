"""`python -m tests.support.faulty_exporter --faults=FILE <exporter flags>`: the exporter daemon over the
simulated NVML with a fault plan (tests/support/nvml_faults.py) applied. Needs --simulate; a bad plan exits
2 with one line, like any bad flag of the daemon."""
from __future__ import annotations

import functools
import sys

from exporter import cli
from tests.support.nvml_faults import FaultPlanError, FaultyNVML, load_fault_plan


def main(argv: list[str]) -> int:
    plans = [arg.partition("=")[2] for arg in argv if arg.startswith("--faults=")]
    rest = [arg for arg in argv if not arg.startswith("--faults=")]
    try:
        devices, faults = load_fault_plan(plans[-1]) if plans else ({}, [])
    except FaultPlanError as exc:
        print(f"{cli.PROG}: error: {exc}", file=sys.stderr)
        return 2
    return cli.main(rest, simulator=functools.partial(FaultyNVML, devices=devices, faults=faults))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
