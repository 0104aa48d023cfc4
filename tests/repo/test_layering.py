"""Dependencies run one way, as the data does: NVML -> exporter; a training loop's log() -> trainer_hook ->
Pushgateway / remote write / pull; the `dualtrack` command reads what those wrote (records, Prometheus).
Every module's imports are read with ast (nothing is imported)."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.support.paths import REPO

#: The packages each package may import. The exporter (a daemon of its own) and the hook (inside every
#: training process) import no other package. The `dualtrack` command reads records and the Pushgateway
#: through the hook's torch-free modules and names XIDs from the exporter's catalogue (THROUGH). The demo
#: stack runs the simulated exporter and the hook; the dashboards are PromQL only; bench measures every
#: package with the tests' helpers, so the tests never import bench.
ALLOWED: dict[str, set[str]] = {
    "exporter": set(),
    "trainer_hook": set(),
    "dualtrack": {"trainer_hook", "exporter"},
    "stack": {"exporter", "trainer_hook"},
    "dashboards": set(),
    "bench": {"exporter", "trainer_hook", "dualtrack", "stack", "tests"},
    "tests": {"exporter", "trainer_hook", "dualtrack", "stack", "dashboards"},
}
#: Edges allowed only into these modules: the `dualtrack` command must not load torch, and the hook's
#: contract, connection (URLs, TLS), credentials (which sink, with which secret) and text modules are the
#: ones it shares.
THROUGH: dict[tuple[str, str], set[str]] = {
    ("dualtrack", "trainer_hook"): {"trainer_hook.contract", "trainer_hook.connection", "trainer_hook.credentials",
                                    "trainer_hook.text"},
    ("dualtrack", "exporter"): {"exporter.xids"},
}
#: The one module of each package that may import the package's command line (and `__main__`).
CLI = {"dualtrack": "dualtrack.cli"}
#: Packages that must never reach torch through their imports, at any depth.
TORCH_FREE = ("exporter", "dualtrack")


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _import_nodes(tree: ast.AST, at_load: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of `tree`; `at_load`: only those importing the module runs (none inside a
    function, none under `if TYPE_CHECKING:`)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif at_load and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif at_load and isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            yield from _import_nodes(ast.Module(body=node.orelse, type_ignores=[]), at_load)
        else:
            yield from _import_nodes(node, at_load)


def imports(path: Path, at_load: bool = False) -> set[str]:
    """The modules `path` imports, at any depth or, `at_load`, when it is imported (relative imports
    resolved; `from package import module` names the module, `from module import name` the module)."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    names: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), at_load):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        else:
            parts = [*package[:len(package) - node.level + 1]] if node.level else []
            base = ".".join([*parts, *([node.module] if node.module else [])])
            submodules = {f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")}
            names.update(submodules or {base})
    return names


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def relative(path: Path) -> str:
    return str(path.relative_to(REPO))


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def forbidden_edges(path: Path) -> list[str]:
    """Each import of `path` that the tables forbid, as 'FILE imports MODULE (edge A -> B ...)'."""
    own = path.relative_to(REPO).parts[0]
    found = []
    for name in sorted(imports(path)):
        target = name.split(".")[0]
        if target not in ALLOWED or target == own:
            continue
        where = f"{relative(path)} imports {name}"
        if target not in ALLOWED[own]:
            found.append(f"{where} (edge {own} -> {target} is not allowed)")
        elif (own, target) in THROUGH and not any(_under(name, entry) for entry in THROUGH[own, target]):
            found.append(f"{where} (edge {own} -> {target} only through {', '.join(sorted(THROUGH[own, target]))})")
    return found


@cache
def _file(name: str) -> Path | None:
    path = REPO.joinpath(*name.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def reached(path: Path) -> dict[str, str]:
    """Every module that running `path` may load through the repository's own modules, each with the
    module that imports it first: all the imports of the torch-free packages' modules (any of their
    functions may run), what importing the others runs (packages' `__init__` included)."""
    seen = {module_name(path): ""}
    todo = [path]
    while todo:
        current = todo.pop()
        importer = module_name(current)
        for name in sorted(imports(current, at_load=importer.split(".")[0] not in TORCH_FREE)):
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):  # `import a.b` runs a/__init__.py, then a/b.py
                prefix = ".".join(parts[:depth])
                if prefix not in seen:
                    seen[prefix] = importer
                    file = _file(prefix)
                    if file is not None:
                        todo.append(file)
    return seen


def test_imports_are_read_relative_ones_included() -> None:
    assert "dualtrack.cli" in imports(REPO / "dualtrack" / "__main__.py")
    assert {"trainer_hook.contract", "trainer_hook.connection"} <= imports(REPO / "trainer_hook" / "push.py")
    assert "exporter.protowire" in imports(REPO / "exporter" / "collectors" / "podresources.py")


def test_the_allowed_edges_form_no_cycle() -> None:
    def below(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, " -> ".join((*path, package))
        for target in ALLOWED[package]:
            below(target, (*path, package))

    for package in ALLOWED:
        below(package, ())


@pytest.mark.parametrize("path", [p for package in ALLOWED for p in modules(package)], ids=relative)
def test_every_import_follows_an_allowed_edge(path: Path) -> None:
    found = forbidden_edges(path)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", [p for package, cli in CLI.items() for p in modules(package)
                                  if module_name(p) not in (cli, f"{package}.__main__")], ids=relative)
def test_nothing_below_the_command_line_imports_it(path: Path) -> None:
    package = path.relative_to(REPO).parts[0]
    offending = sorted(name for name in imports(path) if _under(name, CLI[package]))
    assert not offending, f"{relative(path)} imports {', '.join(offending)} (below {CLI[package]})"


@pytest.mark.parametrize("path", [p for package in TORCH_FREE for p in modules(package)], ids=relative)
def test_torch_free_packages_never_reach_torch(path: Path) -> None:
    """The static side of tests/trainer_hook/test_contract.py's runs of `dualtrack` (which check sys.modules)."""
    found = reached(path)
    chain = ["torch"]
    while chain[-1] in found and found[chain[-1]]:
        chain.append(found[chain[-1]])
    assert "torch" not in found, f"{relative(path)} loads torch: {' -> '.join(reversed(chain))}"
