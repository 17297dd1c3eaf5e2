"""This process while it starts vLLM and stops it: the environment and CPU binding the engine
core inherits, the folder of its IPC sockets, the /dev/shm queues of the processes it started
(which those are, and their priority: ``runtime.py``), blocking calls in a thread that keeps
no reference to the engine, and the garbage collector's frozen generation around the engine's
life."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from rollout_fleet.adapters.shared.shm import (
    SEGMENT_PREFIX, TENSOR_PARALLEL_PREFIX, SharedMemoryTracker,
)
from rollout_fleet.adapters.vllm.host.ipc_folder import (
    ENGINE_FOLDER_PREFIX, RPC_BASE_PATH, chosen_ipc_folder,
)

log = logging.getLogger(__name__)

_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
# What an engine core and its ranks leave in /dev/shm when killed or slow to stop (not the
# multiprocessing semaphores: this process may hold those too).
ENGINE_FILE_PREFIXES = (SEGMENT_PREFIX, TENSOR_PARALLEL_PREFIX)


async def in_thread(function: Any, *args: Any) -> Any:
    """Run a blocking call in a thread of its own, keeping no reference to its result or its
    function afterwards: anything left holding the vLLM engine keeps it alive past ``close``,
    and its late ``__del__`` then runs a second shutdown while the interpreter exits."""
    loop = asyncio.get_running_loop()
    waiting = loop.create_future()
    settles: list[asyncio.Future[Any]] = [waiting]  # emptied once awaited: the thread lets go
    outcome: list[tuple[Any, BaseException | None]] = []  # emptied by the loop, not the thread

    def run() -> None:
        try:
            outcome.append((function(*args), None))
        except BaseException as error:  # handed to the awaiting coroutine
            outcome.append((None, error))
        loop.call_soon_threadsafe(_settle, settles, outcome)

    threading.Thread(target=run, name="vllm-blocking-call", daemon=True).start()
    try:
        return await waiting
    finally:
        settles.clear()
        function, args = None, ()  # the thread's closure cells let go too


def _settle(settles: list[asyncio.Future[Any]], outcome: list) -> None:
    result, error = outcome.pop()
    if not settles or settles[0].cancelled():  # no one waits for it any more
        return
    if error is not None:
        settles[0].set_exception(error)
    else:
        settles[0].set_result(result)


@contextlib.contextmanager
def pinned_to_cpus(binding: str | None) -> Iterator[None]:
    """While the engine starts, tell vLLM which cores to bind its model threads to (``binding``:
    ``VllmEngineConfig.omp_binding``): its engine-core process reads the variable from the
    environment it inherits."""
    with scoped_environment({} if binding is None else {_OMP_BIND: binding}):
        yield


@contextlib.contextmanager
def scoped_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in this process's environment while vLLM starts: its engine core and
    workers inherit them; each is put back as it was after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        unset = [name for name, value in before.items() if value is None]
        os.environ.update({name: value for name, value in before.items() if value is not None})
        for name in unset:
            os.environ.pop(name, None)


def ipc_environment() -> tuple[str | None, dict[str, str]]:
    """(a new folder, the environment that puts vLLM's IPC socket files in it) for an engine
    about to start, or (None, {}) where the folder is chosen (``VLLM_RPC_BASE_PATH``: the
    user's, or a fleet worker's own, which its placement removes once the worker is gone).
    vLLM names each socket file in the temp folder, and an engine core that is killed, or exits
    without closing its sockets, leaves them there; the engine's close removes this folder with
    whatever is left in it. vLLM reads the variable when it builds the sockets: in this process
    (the front) it caches its environment only when the engine core runs in-process, which the
    fleet never asks for."""
    # Another engine's folder (two starting at once in one process) is not a choice.
    if chosen_ipc_folder() is not None:
        return None, {}
    folder = tempfile.mkdtemp(prefix=ENGINE_FOLDER_PREFIX)
    return folder, {RPC_BASE_PATH: folder}


def track_segments(engine_processes: set[int]) -> list[SharedMemoryTracker]:
    """Record the /dev/shm queues of the engine core(s) just started and their workers, and the
    buffers their tensor-parallel ranks share."""
    segments = [SharedMemoryTracker(pid, remove_unused=False, prefix=ENGINE_FILE_PREFIXES)
                for pid in sorted(engine_processes)]
    for tracker in segments:
        tracker.scan()
    return segments


def freeze_startup_objects() -> None:
    """As vLLM's own server does after init: the millions of objects that importing and
    building the engine left behind go to the permanent generation, else every full
    collection scans them (0.2-0.5 s with the loop and GIL held, here)."""
    gc.collect()
    gc.freeze()


def unfreeze_and_collect() -> None:
    gc.unfreeze()  # start() froze the engine's objects; a frozen cycle is never collected
    gc.collect()  # collect it now: a late __del__ at interpreter exit would shut down twice
