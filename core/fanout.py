"""How the driver reaches every worker at once: its control calls, and a refit's bytes.

Control calls: one call, bounded by a timeout, and the fan-out to every worker at once,
failures named per worker. The refit, sleep and partial-rollout services all send their steps
this way.

A refit's bytes, with the ``tree`` fan-out: who relays which piece to whom, over two binary
trees of a group's workers. The trainer (data rank 0) hands each piece of a refit to the head of one tree, the one that has
carried fewer bytes so far (``PieceRoutes``); a worker receives each piece from its parent in
that piece's tree and sends it on to its children there. Tree A is a binary heap over the workers in data-rank order (1..N), tree B the same heap over them in
reverse order (N..1). The workers with children in A (data ranks 1..N//2) are leaves in B, and
those with children in B (the last N//2) are leaves in A. So every worker receives each byte
once and sends at most the refit's bytes and one piece in all (two children, half of the bytes),
as the trainer does: what crosses any one link stays the same however many workers there are, and a
piece reaches the deepest worker in ``depth`` = floor(log2 N) + 1 hops. NCCL builds its double
binary trees the same way for its all-reduce.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.core.control import WorkerControl
from rollout_fleet.core.errors import InvalidValue, RefitError, WorkerFailures
from rollout_fleet.core.validate import is_int, positive_int


@attrs.frozen
class ControlCall:
    """One control request to one worker, not yet sent (a driver may run it where it likes)."""

    control: WorkerControl
    name: str
    body: Mapping[str, Any]

    @property
    def worker_id(self) -> str:
        return self.control.worker_id


async def run_control_call(call: ControlCall, timeout_s: float) -> Mapping[str, Any]:
    """Send one control call, bounded by ``timeout_s``."""
    try:
        return await asyncio.wait_for(call.control.call(call.name, call.body, timeout_s=timeout_s),
                                      timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        raise RefitError(f"{call.name} on worker {call.worker_id} timed out after "
                         f"{timeout_s:g} s") from None


async def gather_workers(step: str, calls: Mapping[str, Awaitable[Any]]) -> dict[str, Any]:
    """Await every worker's call; raise WorkerFailures naming each one that failed."""
    names = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    failures = {n: r for n, r in zip(names, results) if isinstance(r, BaseException)}
    if failures:
        raise WorkerFailures(step, failures)
    return dict(zip(names, results))


async def call_everywhere(controls: Sequence[WorkerControl], step: str, body: Mapping[str, Any],
                          timeout_s: float) -> dict[str, Any]:
    """``step`` with ``body`` on every worker of ``controls`` at once: each worker's answer,
    or WorkerFailures naming each one that failed."""
    return await gather_workers(step, {
        c.worker_id: run_control_call(ControlCall(c, step, body), timeout_s) for c in controls})


# -- the relay trees of a refit's bytes -------------------------------------------------------
TREES = 2
TRAINER = 0  # the data rank that sends every piece


@attrs.frozen
class RelayTrees:
    """The two trees over data ranks 1..``workers`` (the trainer is data rank 0)."""

    workers: int = attrs.field(validator=positive_int("workers"))

    @property
    def depth(self) -> int:
        """Hops from the trainer to the deepest worker of either tree."""
        return self.workers.bit_length()

    def parent(self, tree: int, data_rank: int) -> int:
        """Whom ``data_rank`` receives the pieces of ``tree`` from (0: the trainer)."""
        position = self._position(tree, self._check_worker(data_rank))
        return TRAINER if position == 1 else self._rank(tree, position // 2)

    def children(self, tree: int, data_rank: int) -> tuple[int, ...]:
        """Whom ``data_rank`` sends the pieces of ``tree`` on to (the trainer: the tree's head)."""
        if data_rank == TRAINER:
            return (self._rank(self._check_tree(tree), 1),)
        position = self._position(tree, self._check_worker(data_rank))
        return tuple(self._rank(tree, child) for child in (2 * position, 2 * position + 1)
                     if child <= self.workers)

    def _rank(self, tree: int, position: int) -> int:
        """The data rank at heap position ``position`` (1-based) of ``tree``."""
        return position if tree == 0 else self.workers + 1 - position

    def _position(self, tree: int, data_rank: int) -> int:
        return self._rank(self._check_tree(tree), data_rank)  # the mapping is its own inverse

    def _check_worker(self, data_rank: int) -> int:
        if not is_int(data_rank) or not 1 <= data_rank <= self.workers:
            raise InvalidValue("data_rank", data_rank, f"a worker is in [1, {self.workers}]")
        return data_rank

    @staticmethod
    def _check_tree(tree: int) -> int:
        if not is_int(tree) or not 0 <= tree < TREES:
            raise InvalidValue("tree", tree, f"must be in [0, {TREES})")
        return tree


class PieceRoutes:
    """The tree each piece of one refit travels, piece after piece in the refit's order: the
    tree that has carried fewer bytes so far (tree A on a tie), so each carries half of the
    bytes to within one piece. The trainer and every worker walk the same pieces alike."""

    def __init__(self) -> None:
        self._carried = [0] * TREES

    def next_tree(self, nbytes: int) -> int:
        tree = min(range(TREES), key=self._carried.__getitem__)
        self._carried[tree] += nbytes
        return tree
