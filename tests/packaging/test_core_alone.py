"""A wheel of the project, installed into a venv holding only attrs, gives a working core."""

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.packaging


# What a build of the sources needs; the rest (the venv, run folders, earlier builds) stays.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "out",
                                     "runs", "gpu-out", ".hypothesis", "__pycache__")


def test_core_works_in_a_venv_with_only_attrs(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources it builds.
    sources = tmp_path / "sources"
    shutil.copytree(ROOT, sources, ignore=NOT_SOURCES)
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir),
                    str(sources)], check=True)
    (wheel,) = wheel_dir.glob("rollout_fleet-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "attrs"], check=True)
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, check=True).stdout
    others = {line.split("==")[0].lower() for line in listed.split()} - {"attrs", "rollout-fleet", "pip", "setuptools"}
    assert others == set(), f"the venv holds more than attrs: {others}"
    code = ("import rollout_fleet.core.rollout_client, rollout_fleet.core.refit, rollout_fleet.ports;"
            "from rollout_fleet.core.rollout import RolloutRequest;"
            "print(RolloutRequest('a', [1], 2).max_new_tokens)")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"
