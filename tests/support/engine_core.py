"""Find a vLLM worker's engine-core process (for tests that kill it or read its memory)."""

from __future__ import annotations


def engine_core_of(worker_pid: int):
    """The psutil.Process of the engine core under a worker's host process.

    By its title (``VLLM::EngineCore``) when vLLM has set it; else by its place: the one child
    of the host that runs processes of its own (vLLM's model worker), not multiprocessing's
    resource tracker. The title was missing in some runs.
    """
    import psutil

    children = psutil.Process(worker_pid).children()
    by_title = [c for c in children if "EngineCor" in _title(c)]
    if len(by_title) == 1:
        return by_title[0]
    by_place = [c for c in children if _has_children(c) and "resource_tracker" not in _title(c)]
    assert len(by_place) == 1, f"worker {worker_pid}: {[(c.pid, _title(c)) for c in children]}"
    return by_place[0]


def _title(process) -> str:
    import psutil

    try:
        return " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return "(gone)"


def _has_children(process) -> bool:
    import psutil

    try:
        return bool(process.children())
    except psutil.Error:
        return False
