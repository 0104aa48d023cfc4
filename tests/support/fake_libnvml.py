"""A fake libnvidia-ml.so.1 (tests/support/fake_nvml.c) built with gcc, for tests that run nvidia-ml-py's own code."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).parent / "fake_nvml.c"
LIBRARY = "libnvidia-ml.so.1"  # the name nvidia-ml-py loads (CDLL, found through LD_LIBRARY_PATH)
PCIE_TX, PCIE_RX, WATTS, INSTANT_WATTS = 6.0e9, 2.5e9, 300.0, 450.0  # as fake_nvml.c defines them


def build(directory: Path) -> Path:
    """Compile the fake into `directory`/libnvidia-ml.so.1 and return `directory`; skips without gcc."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc) to build the fake libnvidia-ml.so.1")
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(directory / LIBRARY),
                    str(SOURCE)], check=True, capture_output=True, text=True)
    return directory
