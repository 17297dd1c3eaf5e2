"""Find a vLLM worker's engine-core and model-worker processes (for tests that kill them, read
their memory or their CPU binding)."""

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


def model_worker_of(worker_pid: int):
    """The psutil.Process of vLLM's model worker under a worker's host (one engine rank)."""
    (worker,) = model_workers_of(worker_pid)
    return worker


def model_workers_of(worker_pid: int) -> list:
    """The psutil.Processes of vLLM's model workers (one per engine rank) under a worker's
    host: by their titles (``VLLM::Worker*``), else the engine core's children that are not
    multiprocessing's resource tracker."""
    import psutil

    by_title = [p for p in psutil.Process(worker_pid).children(recursive=True)
                if _title(p).startswith("VLLM::Worker")]
    if by_title:
        return by_title
    core = engine_core_of(worker_pid)
    by_place = [c for c in core.children() if "resource_tracker" not in _title(c)]
    assert by_place, f"engine core {core.pid}: {[(c.pid, _title(c)) for c in core.children()]}"
    return by_place


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
