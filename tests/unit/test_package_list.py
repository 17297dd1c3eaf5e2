"""Every package folder under the layer folders is installed (pyproject lists packages explicitly)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"core": "rollout_fleet.core", "ports": "rollout_fleet.ports",
          "adapters": "rollout_fleet.adapters", "wiring": "rollout_fleet.wiring"}


def test_every_package_folder_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = set()
    for folder, name in LAYERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((name, *parts)))
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "pyproject lists packages that have no folder"
