"""Every command the README, docs/ and the bench results show exists and answers `--help`: the
`rollout-fleet` subcommands, the scripts, the benches and the examples named in their code
spans and blocks.
A renamed or removed command fails here, with the page that still shows it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import ROOT, cli_env
from rollout_fleet.wiring.cli import build_parser

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "bench").glob("RESULTS*.md"))]
_CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)
# `rollout-fleet <word> failed: ...` is a worker's log line, not a command.
_SUBCOMMAND = re.compile(r"(?:^|[\s$(])rollout-fleet ([a-z][a-z-]*)\b(?! failed:)")
_SCRIPT = re.compile(r"(?:^|[\s(])((?:scripts|bench|examples)/[a-z_]+\.(?:py|sh))\b")
# Modules in bench/ that are helpers of the benches, not commands.
_NOT_COMMANDS = {"bench/fresh_prompts.py", "bench/llama_shapes.py", "bench/private_netns.py",
                 "bench/process_load.py"}


def _code_of(page: Path) -> str:
    return "\n".join(block or span for block, span in _CODE.findall(page.read_text()))


def _shown():
    subcommands, scripts = {}, {}
    for page in PAGES:
        code = _code_of(page)
        for name in _SUBCOMMAND.findall(code):
            subcommands.setdefault(name, page.name)
        for path in _SCRIPT.findall(code):
            scripts.setdefault(path, page.name)
    return subcommands, scripts


SUBCOMMANDS, SCRIPTS = _shown()


def test_the_pages_show_commands_at_all():
    assert {"serve", "generate", "refit", "demo"} <= set(SUBCOMMANDS)
    assert "scripts/test.sh" in SCRIPTS and any(p.startswith("bench/") for p in SCRIPTS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_documented_subcommand_exists_and_answers_help(name):
    known = set(build_parser()._subparsers._group_actions[0].choices)
    assert name in known, f"{SUBCOMMANDS[name]} shows `rollout-fleet {name}`; the command has " \
                          f"{sorted(known)}"
    result = subprocess.run([sys.executable, "-m", "rollout_fleet.wiring.cli", name, "--help"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, env=cli_env())
    assert result.returncode == 0 and "usage: rollout-fleet" in result.stdout, result.stderr


@pytest.mark.parametrize("path", sorted(SCRIPTS))
def test_each_documented_script_exists_and_answers_help(path):
    script = ROOT / path
    assert script.is_file(), f"{SCRIPTS[path]} shows {path}, which is not in the repository"
    if path in _NOT_COMMANDS:
        return
    if path.startswith("examples/"):  # quick, in-memory: run as the page shows them
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                                timeout=300, cwd=ROOT, env=cli_env(), stdin=subprocess.DEVNULL)
        assert result.returncode == 0, (result.stdout + result.stderr)[-2000:]
        return
    if path == "scripts/venv.sh":  # takes no arguments: it prints the venv's python
        result = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                                timeout=900, cwd=ROOT, env=cli_env(), stdin=subprocess.DEVNULL)
        assert result.returncode == 0 and Path(result.stdout.split()[-1]).is_file(), result.stderr
        return
    if path.endswith(".sh"):
        command = ["bash", str(script), "--help"]
    else:
        command = [sys.executable, str(script), "--help"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=cli_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{path} --help: exit {result.returncode}\n" \
                                   f"{(result.stdout + result.stderr)[-2000:]}"
    assert "usage" in (result.stdout + result.stderr).lower(), result.stdout[-2000:]
