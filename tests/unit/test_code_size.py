"""Files and functions of the package stay small enough to read: no file over 400 lines and
no function over 60 in core/, ports/, adapters/, wiring/ (an AST walk of the sources)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("core", "ports", "adapters", "wiring")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# Known exceptions, each pending its split.
LONG_FILES_PENDING: set[str] = set()


def _sources() -> list[Path]:
    return sorted(path for layer in LAYERS for path in (ROOT / layer).rglob("*.py"))


def _long_functions(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            lines = node.end_lineno - start + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{start} {node.name}: {lines} lines")
    return found


def test_the_layers_have_sources():
    assert len(_sources()) > 50


def test_no_file_is_over_400_lines():
    long = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in _sources()}
    over = {name: n for name, n in long.items()
            if n > MAX_FILE_LINES and name not in LONG_FILES_PENDING}
    assert over == {}, f"files over {MAX_FILE_LINES} lines: {over}"


def test_no_function_is_over_60_lines():
    over = [line for path in _sources() for line in _long_functions(path)]
    assert over == [], "functions over 60 lines:\n" + "\n".join(over)


def test_every_known_exception_still_exists():
    assert all((ROOT / name).is_file() for name in LONG_FILES_PENDING)
