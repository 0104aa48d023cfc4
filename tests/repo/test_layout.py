"""The layout of tests/: test files live in one folder per package under test, never directly in tests/,
and no module imports a test module (what tests share lives in tests/support/ or tests/conftest.py)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import SUPPORT, TESTS

#: What may sit directly in tests/ besides the folders.
TOP_LEVEL = {"__init__.py", "conftest.py"}


def is_test_module(name: str) -> bool:
    """Whether a dotted module name (or a name imported from a package) is a test module."""
    return name.rsplit(".", 1)[-1].startswith("test_")


def imported_test_modules(path: Path) -> list[str]:
    """`line: module` for each import of a test module in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            names = [module] if is_test_module(module) else [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if is_test_module(name)]
    return found


def test_no_module_imports_a_test_module():
    imports = {str(path.relative_to(TESTS)): found for path in sorted(TESTS.rglob("*.py"))
               if (found := imported_test_modules(path))}
    assert imports == {}, "move what they share into tests/support/ or tests/conftest.py"


def test_test_files_sit_in_a_package_folder_and_helpers_in_support():
    files = {path.name for path in TESTS.iterdir() if path.is_file() and path.suffix == ".py"}
    assert files <= TOP_LEVEL, f"test files go in a folder by package, not directly in tests/: {files - TOP_LEVEL}"
    folders = {path.parent for path in TESTS.rglob("test_*.py")}
    assert SUPPORT not in folders, "tests/support/ holds helpers only"
    assert {folder for folder in folders if not (folder / "__init__.py").is_file()} == set()


def test_a_planted_import_of_a_test_module_is_found(tmp_path):
    path = tmp_path / "test_planted.py"
    path.write_text("import os\nfrom tests.dualtrack.test_replay import write\nfrom tests.stack import test_rules\n"
                    "from .test_sibling import x\nfrom tests.support.records import write\n")
    assert imported_test_modules(path) == ["2: tests.dualtrack.test_replay", "3: tests.stack.test_rules",
                                           "4: .test_sibling"]
