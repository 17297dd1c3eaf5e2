"""The benches and the tests import in one direction: the tests may import the benches (to test
them) and support/; the benches import support/ but nothing of the tests; support/ imports
neither. A helper both need lives in support/."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.trees import write_tree

ROOT = Path(__file__).resolve().parents[2]


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a module, and of every importlib.import_module
    or __import__ call given a literal name."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            found.append((node.lineno, node.args[0].value))
    return found


def forbidden_imports(root: Path) -> list[str]:
    """Each import that breaks the direction, as 'path:line: imports name (why)'."""
    bench_modules = {path.stem for path in (root / "bench").glob("*.py")}
    rules = {
        "bench": ({"tests"}, "the benches import nothing of the tests"),
        "support": ({"tests", "bench"} | bench_modules, "support/ imports neither the tests nor the benches"),
    }
    found = []
    for folder, (banned, why) in rules.items():
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, name in _imported_names(tree):
                if name.split(".")[0] in banned:
                    found.append(f"{path.relative_to(root)}:{line}: imports {name} ({why})")
    return found


def test_the_repository_imports_in_one_direction():
    assert forbidden_imports(ROOT) == []


def test_a_bench_importing_the_tests_and_support_importing_a_bench_are_caught(tmp_path):
    root = write_tree(tmp_path, {
        "bench/bench_x.py": "import sys\nfrom support.gpu_models import SMALL\n"
                            "def f():\n    from tests.support.net import free_port\n",
        "bench/fresh_prompts.py": "import importlib\nm = importlib.import_module('tests.support')\n",
        "support/helper.py": "import bench_x\nfrom bench import fresh_prompts\nimport tests\nimport testsuite\n",
        "tests/test_y.py": "import bench_x\nfrom support.helper import thing\n",
    })
    assert forbidden_imports(root) == [
        "bench/bench_x.py:4: imports tests.support.net (the benches import nothing of the tests)",
        "bench/fresh_prompts.py:2: imports tests.support (the benches import nothing of the tests)",
        "support/helper.py:1: imports bench_x (support/ imports neither the tests nor the benches)",
        "support/helper.py:2: imports bench (support/ imports neither the tests nor the benches)",
        "support/helper.py:3: imports tests (support/ imports neither the tests nor the benches)",
    ]
