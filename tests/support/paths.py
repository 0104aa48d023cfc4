"""Where things are: the repository root and the tests' own folders."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
SUPPORT = TESTS / "support"
