"""Dependencies run one way: the hook is the lower layer, the `dualtrack` command the upper one, and
the exporter stands apart. Every module's imports are read with ast (nothing is imported)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import REPO


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> set[str]:
    """The modules `path` imports, at any depth (relative imports resolved; `from package import
    module` names the module, `from module import name` the module)."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = [*package[:len(package) - node.level + 1]] if node.level else []
            base = ".".join([*parts, *([node.module] if node.module else [])])
            submodules = {f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")}
            names.update(submodules or {base})
    return names


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_imports_are_read_relative_ones_included() -> None:
    assert "dualtrack.cli" in imports(REPO / "dualtrack" / "__main__.py")
    assert {"trainer_hook.contract", "trainer_hook.connection"} <= imports(REPO / "trainer_hook" / "push.py")
    assert "trainer_hook.protobuf" in imports(REPO / "trainer_hook" / "remote_write.py")


@pytest.mark.parametrize("path", modules("trainer_hook"), ids=str)
def test_the_hook_never_imports_the_dualtrack_command(path: Path) -> None:
    assert not {name for name in imports(path) if _under(name, "dualtrack")}, path


@pytest.mark.parametrize("path", [p for p in modules("dualtrack") if p.name not in ("cli.py", "__main__.py")],
                         ids=str)
def test_nothing_below_the_cli_imports_it(path: Path) -> None:
    assert not {name for name in imports(path) if _under(name, "dualtrack.cli")}, path


@pytest.mark.parametrize("path", modules("exporter"), ids=str)
def test_the_exporter_imports_neither_the_hook_nor_the_cli(path: Path) -> None:
    assert not {name for name in imports(path) if _under(name, "trainer_hook") or _under(name, "dualtrack.cli")}, path
