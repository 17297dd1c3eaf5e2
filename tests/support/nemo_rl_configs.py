"""NeMo-RL's shipped example configs (vendored in tests/nemo_rl_upstream/configs), loaded as
NeMo-RL loads them: ``defaults:`` merged under the file, then ``${a.b}`` and ``${.x}``
interpolations resolved (NeMo-RL uses OmegaConf; these files need only these two forms)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "nemo_rl_upstream" / "configs"
_WHOLE = re.compile(r"^\$\{([^}]+)\}$")


def load_example(name: str) -> dict:
    """The whole config of ``examples/configs/<name>``, merged and resolved."""
    config = _load(CONFIGS / name)
    return _resolve(config, config, [])


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    parent = data.pop("defaults", None)
    if parent is None:
        return data
    return _merge(_load(path.parent / parent), data)


def _merge(base: dict, over: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _resolve(value: Any, root: dict, where: list[str]) -> Any:
    if isinstance(value, dict):
        return {k: _resolve(v, root, [*where, k]) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, root, where) for v in value]
    if isinstance(value, str) and (match := _WHOLE.match(value)):
        path = match.group(1)
        if path.startswith("."):  # relative: a sibling of the key
            target = _lookup(root, [*where[:-1], *path[1:].split(".")])
        else:
            target = _lookup(root, path.split("."))
        return _resolve(target, root, where)
    return value


def _lookup(root: dict, path: list[str]) -> Any:
    node: Any = root
    for key in path:
        node = node[key]
    return node
