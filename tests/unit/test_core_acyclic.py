"""The core's modules import each other without a circle (and so do the ports'), and the
check itself catches one.

The graph is read from the AST: every import counts, at module level, inside a function or
under ``if TYPE_CHECKING`` alike, so no circle can hide behind a deferred import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.trees import write_tree

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path, folder: Path) -> str:
    """``core/a/b.py`` -> ``rollout_fleet.core.a.b`` (a layer folder installs as
    ``rollout_fleet.<layer>``)."""
    parts = path.relative_to(folder).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("rollout_fleet", folder.name, *parts))


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module an ``ImportFrom`` names, with a relative one resolved against its importer."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.AST, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules one import statement loads (a name imported from a package
    counts as its submodule where one of that name exists, else as the package)."""
    if isinstance(node, ast.Import):
        named = {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
        source = _absolute(node, importer, is_package)
        named = {f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                 for alias in node.names}
    else:
        return set()
    found = set()
    for name in named:  # "a.b.c" loads a.b.c, or the nearest module above it
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph(folder: Path) -> dict[str, set[str]]:
    """Every module of the layer package in ``folder`` -> the modules of that package it
    imports (another layer's are left out: the layer rules order the layers)."""
    paths = {_module_name(path, folder): path for path in sorted(folder.rglob("*.py"))}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {target for node in ast.walk(tree)
                       for target in _targets(node, name, is_package, modules)} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as the modules along it (the first repeated at the end), or
    None. A depth-first walk: an edge back to a module still on the path closes a circle."""
    done: set[str] = set()
    path: list[str] = []

    def walk(module: str) -> list[str] | None:
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target in path:
                return path[path.index(target):] + [target]
            if target not in done:
                cycle = walk(target)
                if cycle:
                    return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = walk(module)
            if cycle:
                return cycle
    return None


@pytest.mark.parametrize("layer", ["core", "ports"])
def test_the_layer_imports_without_a_circle(layer):
    graph = import_graph(ROOT / layer)
    assert len(graph) > 10 and any(graph.values())
    cycle = find_cycle(graph)
    assert cycle is None, f"{layer} imports in a circle: " + " -> ".join(cycle or ())


def test_a_circle_through_deferred_imports_is_caught(tmp_path):
    core = write_tree(tmp_path, {
        "core/__init__.py": "",
        "core/a.py": "from rollout_fleet.core.b import B\n",
        "core/b.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from rollout_fleet.core import c
            """,
        "core/c.py": "def later():\n    from rollout_fleet.core.a import A\n",
        "core/d.py": "import rollout_fleet.core.a\nfrom . import c\n",
    }) / "core"
    graph = import_graph(core)
    assert graph["rollout_fleet.core.d"] == {"rollout_fleet.core.a", "rollout_fleet.core.c"}
    assert find_cycle(graph) == ["rollout_fleet.core.a", "rollout_fleet.core.b",
                                 "rollout_fleet.core.c", "rollout_fleet.core.a"]


def test_a_tree_without_a_circle_passes(tmp_path):
    core = write_tree(tmp_path, {
        "core/__init__.py": "",
        "core/a.py": "from rollout_fleet.core.b import B\nfrom rollout_fleet.core.c import C\n",
        "core/b.py": "from rollout_fleet.core.c import C\n",
        "core/c.py": "import json\n",
    }) / "core"
    assert find_cycle(import_graph(core)) is None
