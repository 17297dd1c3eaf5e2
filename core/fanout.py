"""How the driver reaches every worker at once: its control calls, and a refit's bytes.

Control calls: one call, bounded by a timeout, and the fan-out to every worker at once,
failures named per worker. The refit, sleep and partial-rollout services all send their steps
this way. A step with one body for more workers than a relay width goes to that many heads,
which pass it on down a tree of the workers (``run_calls``; the tree and a worker's side in
``core/control_relay.py``): the driver's calls per step stay at the width.

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
from rollout_fleet.core.control_relay import (
    RELAY_CONTROL,
    RelayNode,
    RelayRequest,
    child_timeout_s,
    relay_forest,
    subtree_answers,
)
from rollout_fleet.core.errors import (
    ControlRefused,
    InvalidValue,
    NotReached,
    RefitError,
    WireError,
    WorkerFailures,
)
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


# -- control calls relayed down the workers (core/control_relay.py) ---------------------------
def relayable(calls: Sequence[ControlCall], width: int) -> bool:
    """Whether ``calls`` are relayed: a relay asked, more workers than ``width``, one step with
    one body, every worker reachable by its peers."""
    if not width or len(calls) <= width:
        return False
    first = calls[0]
    return all(c.name == first.name and c.body == first.body
               and c.control.relay_address() is not None for c in calls)


def relayed_plan(calls: Sequence[ControlCall], width: int
                 ) -> list[tuple[ControlCall, RelayNode]] | None:
    """The heads' relay calls (each with its subtree) for ``calls``, or None where they go out
    directly (``relayable``)."""
    if not relayable(calls, width):
        return None
    controls = {c.worker_id: c.control for c in calls}
    members = [(c.worker_id, str(c.control.relay_address())) for c in calls]
    return [(ControlCall(controls[head.worker_id], RELAY_CONTROL, {}), head)
            for head in relay_forest(members, width)]


async def call_all(step: str, calls: Sequence[ControlCall], timeout_s: float, *,
                   relay_width: int = 0) -> dict[str, Mapping[str, Any]]:
    """Every worker's answer (``run_calls``); WorkerFailures naming each one that failed."""
    outcome = await run_calls(calls, timeout_s, relay_width=relay_width)
    failures = {w: r for w, r in outcome.items() if isinstance(r, BaseException)}
    if failures:
        raise WorkerFailures(step, failures)
    return {w: r for w, r in outcome.items() if not isinstance(r, BaseException)}


async def run_calls(calls: Sequence[ControlCall], timeout_s: float, *, relay_width: int = 0
                    ) -> dict[str, Mapping[str, Any] | BaseException]:
    """Each worker's answer or its failure, relayed down a tree where ``relayed_plan`` allows."""
    plan = relayed_plan(calls, relay_width)
    if plan is None:
        results = await asyncio.gather(*(run_control_call(c, timeout_s) for c in calls),
                                       return_exceptions=True)
        return {c.worker_id: r for c, r in zip(calls, results)}
    step, body = calls[0].name, calls[0].body
    heads = await asyncio.gather(*(_relay_from(head, node, step, body, timeout_s)
                                   for head, node in plan))
    outcome: dict[str, Mapping[str, Any] | BaseException] = {}
    for answers in heads:
        outcome.update(answers)
    return {c.worker_id: outcome[c.worker_id] for c in calls}  # in the calls' order


async def _relay_from(head: ControlCall, node: RelayNode, step: str, body: Mapping[str, Any],
                      timeout_s: float) -> dict[str, Mapping[str, Any] | BaseException]:
    request = RelayRequest(node.worker_id, step, body, node.children, child_timeout_s(timeout_s))
    try:
        relayed = subtree_answers(
            await run_control_call(attrs.evolve(head, body=request.to_wire()), timeout_s), node)
    except Exception as exc:  # noqa: BLE001 - the head's failure, and none reached below it
        return {node.worker_id: exc, **{
            below: NotReached(f"{step} not answered: the relay through worker "
                              f"{node.worker_id!r} failed ({type(exc).__name__}: {exc})")
            for below in node.members()[1:]}}
    return {worker: _read_relayed(worker, step, answer) for worker, answer in relayed.items()}


def _read_relayed(worker: str, step: str, answer: Any) -> Mapping[str, Any] | BaseException:
    """A relayed answer as the worker's own control call would have ended."""
    if not isinstance(answer, Mapping):
        return WireError(f"worker {worker!r} control {step!r}: a relayed answer that is not a "
                         f"JSON object: {answer!r:.200}")
    if answer.get("status") == "error":
        refusal = NotReached if answer.get("reached") is False else ControlRefused
        return refusal(f"worker {worker!r} control {step!r} refused: "
                       f"{str(answer.get('message'))[:500]}")
    return answer


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
