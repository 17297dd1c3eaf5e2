"""The layer rules, as an AST walk over the four layer folders.

| layer    | may import                                                          |
| core     | the standard library, attrs, rollout_fleet.core                     |
| ports    | the above, rollout_fleet.ports (ports/contracts may also use pytest) |
| adapters | anything but rollout_fleet.wiring and another adapter's package;     |
|          | every adapter may use adapters/shared (standard-library helpers)    |
| adapters/shared | the standard library, attrs, rollout_fleet.core              |
| adapters/vllm/host, adapters/vllm/inside | never each other (adapters/vllm/messages.py) |
| wiring   | anything                                                            |

And each port is declared once: as an abstract class in ports/ (or in core, for a port that a
core service needs), never again as a ``typing.Protocol`` copy elsewhere.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

STDLIB = frozenset(sys.stdlib_module_names)
SHARED = "shared"  # adapters/shared: helpers every adapter may use
# The vLLM adapter's two processes' packages share only adapters/vllm/messages.py.
INSIDE_VLLM = "rollout_fleet.adapters.vllm.inside"
HOST_VLLM = "rollout_fleet.adapters.vllm.host"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def _core_or_ports_allows(module: str, layer: str, in_contracts: bool) -> bool:
    top = module.split(".")[0]
    if top in STDLIB or top == "attrs" or top == "__future__":
        return True
    if module == "rollout_fleet.core" or module.startswith("rollout_fleet.core."):
        return True
    if layer == "ports":
        if module == "rollout_fleet.ports" or module.startswith("rollout_fleet.ports."):
            return True
        if in_contracts and top == "pytest":
            return True
    return False


def violations(root: Path) -> list[str]:
    """Every import in ``root``'s layer folders that breaks a rule, as 'file:line: module (why)'."""
    problems = []
    for layer in ("core", "ports", "adapters"):
        for path in sorted((root / layer).rglob("*.py")):
            rel = path.relative_to(root)
            for line, module in imported_modules(path):
                why = _why_forbidden(layer, rel, module)
                if why:
                    problems.append(f"{rel}:{line}: imports {module} ({why})")
    return problems


def _why_forbidden(layer: str, rel: Path, module: str) -> str | None:
    if module.startswith("."):
        return "relative imports hide the layer; use rollout_fleet.<layer>"
    if layer == "adapters" and rel.parts[1] == SHARED:
        own_package = module.startswith(f"rollout_fleet.adapters.{SHARED}")
        if not own_package and not _core_or_ports_allows(module, "core", False):
            return "adapters/shared may import only the standard library, attrs and core"
        return None
    if layer in ("core", "ports"):
        in_contracts = layer == "ports" and rel.parts[1] == "contracts"
        if not _core_or_ports_allows(module, layer, in_contracts):
            return f"{layer} may import only the standard library, attrs" + (
                " and core" if layer == "ports" else "")
        return None
    if module == "rollout_fleet.wiring" or module.startswith("rollout_fleet.wiring."):
        return "adapters never import the wiring"
    own = rel.parts[1] if len(rel.parts) > 2 else None
    if rel.parts[:3] == ("adapters", "vllm", "host") and module.startswith(INSIDE_VLLM):
        return "the vLLM host never imports what runs inside vLLM; share adapters/vllm/messages.py"
    if rel.parts[:3] == ("adapters", "vllm", "inside") and module.startswith(HOST_VLLM):
        return "what runs inside vLLM never imports the host; share adapters/vllm/messages.py"
    if module.startswith("rollout_fleet.adapters."):
        other = module.split(".")[2]
        if other not in (own, SHARED):
            return f"adapter {own!r} may not import adapter {other!r}; go through a port"
    return None


def protocol_copies(root: Path, allowed: frozenset[str] = frozenset()) -> list[str]:
    """``typing.Protocol`` classes in the layer folders that declare a method of a port (an
    abstract class in core or ports): a port declared a second time, as 'file:line: name'.
    ``allowed``: files to pass over."""
    port_methods = {name for path, cls in _classes(root, ("core", "ports"))
                    if _derives(cls, "ABC") for name in _methods(cls)}
    return [f"{path}:{cls.lineno}: {cls.name}"
            for path, cls in _classes(root, ("core", "ports", "adapters", "wiring"))
            if str(path) not in allowed and _derives(cls, "Protocol")
            and _methods(cls) & port_methods]


def _classes(root: Path, layers: tuple[str, ...]):
    for layer in layers:
        for path in sorted((root / layer).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    yield path.relative_to(root), node


def _derives(cls: ast.ClassDef, base: str) -> bool:
    return any((isinstance(b, ast.Name) and b.id == base)
               or (isinstance(b, ast.Attribute) and b.attr == base) for b in cls.bases)


def _methods(cls: ast.ClassDef) -> set[str]:
    return {node.name for node in cls.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")}
