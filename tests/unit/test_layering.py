"""The dependency rule between layers holds, and the check itself catches a violation."""

import subprocess
import sys
from pathlib import Path

from tests.layering import protocol_copies, violations
from tests.support.trees import write_tree

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_keeps_the_layer_rules():
    assert violations(ROOT) == []


def test_a_forbidden_import_in_core_is_caught(tmp_path):
    root = write_tree(tmp_path, {"core/x.py": "import json\nimport attrs\nimport numpy\n",
                                 "ports/p.py": "", "adapters/a/m.py": ""})
    assert violations(root) == ["core/x.py:3: imports numpy (core may import only the standard library, attrs)"]


def test_core_importing_ports_or_torch_is_caught(tmp_path):
    root = write_tree(tmp_path, {"core/x.py": "def f():\n    import torch\nfrom rollout_fleet.ports import engine\n",
                                 "ports/p.py": "import pytest\n", "ports/contracts/c.py": "import pytest\n",
                                 "adapters/a/m.py": ""})
    found = violations(root)
    assert any("core/x.py:2: imports torch" in v for v in found)
    assert any("core/x.py:3: imports rollout_fleet.ports" in v for v in found)
    assert any("ports/p.py:1: imports pytest" in v for v in found)
    assert not any("contracts" in v for v in found)


def test_adapters_may_not_import_wiring_or_each_other(tmp_path):
    root = write_tree(tmp_path, {"core/x.py": "", "ports/p.py": "",
                                 "adapters/http/m.py": "import httpx\nfrom rollout_fleet.wiring import cli\n"
                                                       "from rollout_fleet.adapters.vllm.host import engine\n"
                                                       "from rollout_fleet.adapters.http import other\n"})
    found = violations(root)
    assert len(found) == 2
    assert "never import the wiring" in found[0] and "may not import adapter 'vllm'" in found[1]


def test_the_vllm_host_and_inside_share_only_their_messages(tmp_path):
    root = write_tree(tmp_path, {"core/x.py": "", "ports/p.py": "",
                                 "adapters/vllm/host/a.py": "from rollout_fleet.adapters.vllm.inside import x\n"
                                                            "from rollout_fleet.adapters.vllm import messages\n",
                                 "adapters/vllm/inside/b.py": "from rollout_fleet.adapters.vllm.host.c import y\n"
                                                              "from rollout_fleet.adapters.vllm.messages import z\n"})
    found = violations(root)
    assert len(found) == 2, found
    assert found[0].startswith("adapters/vllm/host/a.py:1:") and "never imports what runs inside" in found[0]
    assert found[1].startswith("adapters/vllm/inside/b.py:1:") and "never imports the host" in found[1]


def test_importing_core_loads_nothing_heavy():
    code = ("import sys, rollout_fleet.core, pkgutil, importlib\n"
            "for m in pkgutil.iter_modules(rollout_fleet.core.__path__):\n"
            "    importlib.import_module('rollout_fleet.core.' + m.name)\n"
            "heavy = {'torch','httpx','ray','dynamo','vllm','numpy','aiohttp','pytest'} & set(sys.modules)\n"
            "print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_adapters_share_helpers_only_through_adapters_shared(tmp_path):
    root = write_tree(tmp_path, {"core/x.py": "", "ports/p.py": "",
                                 "adapters/local/m.py": "from rollout_fleet.adapters.shared import free_port\n",
                                 "adapters/shared/net.py": "import socket\nfrom rollout_fleet.adapters.shared import processes\n"
                                                           "from rollout_fleet.ports import placement\n"})
    assert violations(root) == ["adapters/shared/net.py:3: imports rollout_fleet.ports "
                                "(adapters/shared may import only the standard library, attrs and core)"]


def test_each_port_is_declared_once_with_no_protocol_copies():
    assert protocol_copies(ROOT) == []


def test_a_protocol_copy_of_a_port_is_caught(tmp_path):
    root = write_tree(tmp_path, {
        "ports/p.py": "from abc import ABC\nclass Engine(ABC):\n    def serve(self): ...\n",
        "core/x.py": "from typing import Protocol\nclass EngineLike(Protocol):\n    def serve(self): ...\n"
                     "class Closable(Protocol):\n    def close(self): ...\n",
        "adapters/a/m.py": "import typing\nclass T(typing.Protocol):\n    async def serve(self): ...\n",
        "wiring/w.py": ""})
    assert protocol_copies(root) == ["core/x.py:2: EngineLike", "adapters/a/m.py:2: T"]


def test_core_reads_the_time_only_through_its_clock_port():
    """Outside core/clock.py no core module calls the time module or sleeps by itself: the
    services take a ``Clock`` (tests inject a fake one)."""
    import ast

    found = []
    for path in sorted((ROOT / "core").glob("*.py")):
        if path.name == "clock.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "time" for a in node.names):
                found.append(f"{path.name}:{node.lineno}: imports time")
            if isinstance(node, ast.ImportFrom) and node.module == "time":
                found.append(f"{path.name}:{node.lineno}: imports from time")
            if isinstance(node, ast.Attribute) and ast.unparse(node) in ("asyncio.sleep", "loop.time"):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
