"""The suite's own arrangement (tests/conftest.py): what starts vLLM runs in one group, and each
pytest-xdist worker has a network namespace and a Ray temp folder of its own."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import BESIDE_ENGINES_NICE, engines_group


def _namespace(path: str) -> str:
    return os.readlink(path)


def test_a_worker_reads_and_binds_in_a_namespace_of_its_own():
    """Taken by the thread that runs the tests, the one /proc/self shows, so the socket checks
    that read /proc/net see what the tests' processes bind; the controller is elsewhere."""
    assert _namespace("/proc/thread-self/ns/net") == _namespace("/proc/self/ns/net")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # under `-n 0` the run is one process: nothing of its own to take
        assert _namespace(f"/proc/{os.getppid()}/ns/net") != _namespace("/proc/self/ns/net")
        ray_folder = Path(os.environ["RAY_TMPDIR"])
        assert ray_folder.is_dir() and worker in ray_folder.name
        # beside the engines group, at the nice of vLLM's CPU processes
        assert os.getpriority(os.PRIO_PROCESS, 0) == BESIDE_ENGINES_NICE


class _Item:
    def __init__(self, path: str, marks: tuple[str, ...] = ()) -> None:
        self.path = Path(__file__).parents[1] / path
        self._marks = marks

    def get_closest_marker(self, name: str):
        return name if name in self._marks else None


def test_vllm_tiers_and_vllm_marked_modules_share_one_group_and_the_rest_their_own():
    assert engines_group(_Item("vllm/test_x.py")) == "engines"
    assert engines_group(_Item("refit/test_x.py")) == "engines"
    assert engines_group(_Item("fleet/test_x.py", ("vllm", "ray"))) == "engines"
    assert engines_group(_Item("fleet/test_x.py", ("ray",))) == "fleet/test_x.py"
    assert engines_group(_Item("nodes/test_x.py", ("ray",))) == "nodes/test_x.py"
