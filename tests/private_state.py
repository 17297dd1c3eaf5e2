"""Private state stays private, as an AST walk over the four layer folders.

- No module imports another project module's private name (``from rollout_fleet.x import _y``):
  what two modules share is public, and named for it.
- No code reads another object's private attribute (``other._state``) where that name is one
  the project defines on its own classes: an object's state is changed through its methods.
- A class reads only the private attributes and methods it defines itself (``self._x`` set or
  declared in its own body): no mixin or subclass leans on a field another class owns. A part
  that needs shared state is handed the object that owns it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

LAYERS = ("core", "ports", "adapters", "wiring")
PACKAGE = "rollout_fleet"


def sources(root: Path) -> list[Path]:
    return sorted(path for layer in LAYERS if (root / layer).is_dir()
                  for path in (root / layer).rglob("*.py"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _trees(root: Path) -> Iterator[tuple[str, ast.Module]]:
    for path in sources(root):
        yield str(path.relative_to(root)), ast.parse(path.read_text(), filename=str(path))


def private_imports(root: Path) -> list[str]:
    found = []
    for rel, tree in _trees(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                found += [f"{rel}:{node.lineno}: imports {alias.name} from {node.module}"
                          for alias in node.names if _is_private(alias.name)]
    return found


def _self_attribute(node: ast.AST) -> ast.Attribute | None:
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls") and _is_private(node.attr)):
        return node
    return None


def _defined_in(cls: ast.ClassDef) -> set[str]:
    """Private names a class defines: methods, class-body fields, attributes it assigns."""
    defined = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        attribute = _self_attribute(node)
        if attribute is not None and isinstance(attribute.ctx, (ast.Store, ast.Del)):
            defined.add(attribute.attr)
    return defined


def borrowed_state(root: Path) -> list[str]:
    found = []
    for rel, tree in _trees(root):
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            defined = _defined_in(cls)
            used = {}
            for node in ast.walk(cls):
                attribute = _self_attribute(node)
                if attribute is not None and attribute.attr not in defined:
                    used.setdefault(attribute.attr, attribute.lineno)
            found += [f"{rel}:{line}: {cls.name} uses self.{name}, which it does not define"
                      for name, line in sorted(used.items(), key=lambda item: item[1])]
    return found


# Private fields of third-party objects the project sets on purpose (torch's gloo options have
# no public setter for them), by file and expression.
THIRD_PARTY_PRIVATE = {("adapters/collective/group.py", "options._timeout")}


def reached_into(root: Path) -> list[str]:
    """``other._name`` where ``_name`` is private state some project class defines, read
    outside that class (a class may reach its own state on another instance of itself)."""
    trees = list(_trees(root))
    project_private = set()
    for _, tree in trees:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            project_private |= {name for name in _defined_in(cls) if _is_private(name)}
    found = []
    for rel, tree in trees:
        own: dict[int, set[str]] = {}  # id of an attribute node -> the names its class defines
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = _defined_in(cls)
            for node in ast.walk(cls):
                own.setdefault(id(node), set()).update(names)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in project_private
                    and _self_attribute(node) is None and node.attr not in own.get(id(node), ())
                    and (rel, ast.unparse(node)) not in THIRD_PARTY_PRIVATE):
                found.append(f"{rel}:{node.lineno}: reads {ast.unparse(node)}")
    return found
