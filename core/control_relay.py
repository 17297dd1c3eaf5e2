"""Control calls relayed down a tree of workers, so the driver's work per fan-out stays flat in N.

A fan-out of one step with one body to N workers costs the driver one call per worker (its CPU
per call, N of them, one after the other on its loop). Relayed, the driver calls only the heads
of a ``width``-ary tree over the workers; each worker runs the step itself and, at once, passes
the call on to its children, and answers with its own answer and every answer of its subtree.
The driver's calls per fan-out are at most ``width``; a worker's, at most ``width``; the depth
is about log_width N round trips.

A worker answers for every worker of its subtree: its child's answers as they came, or, for a
child it could not reach, that child's failure and a "not reached" failure for each worker
below it. Nothing is sent twice: a worker whose relay failed may have run the step, so it is
never called again directly; the fan-out fails naming it, as a direct call's failure would.

Only a fan-out of one step with one body, to more workers than ``width``, each reachable by
its peers (``WorkerControl.relay_address``), is relayed; any other goes out directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.core.control import WorkerControl
from rollout_fleet.core.errors import (
    ControlRefused,
    InvalidValue,
    RefitError,
    WireError,
    WorkerFailures,
)
from rollout_fleet.core.fanout import ControlCall, run_control_call
from rollout_fleet.core.validate import is_int

RELAY_CONTROL = "relay"
DEFAULT_RELAY_WIDTH = 8
# Each level gives its children this much less time than it has, so a child's own failure
# reaches the driver before any caller above gives up.
HOP_MARGIN_S = 0.5
_SHORTEST_HOP_S = 0.1

# (worker id, address) -> a control channel to that peer.
PeerControls = Callable[[str, str], WorkerControl]
# (step, body) -> the worker's own answer, as its control would send it: {"status": ...}.
LocalControl = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


def check_relay_width(width: Any) -> int:
    """0 (every worker called by the driver) or an int >= 2."""
    if not is_int(width) or not (width == 0 or width >= 2):
        raise InvalidValue("control_relay_width", width,
                           "must be 0 (no relay) or an int >= 2 (children per worker)")
    return int(width)


@attrs.frozen
class RelayNode:
    """A worker of the tree: who it is to the driver, where its peers reach it, its children."""

    worker_id: str
    address: str
    children: tuple["RelayNode", ...] = ()

    def members(self) -> tuple[str, ...]:
        """This worker and every worker below it, this one first."""
        return (self.worker_id, *(m for child in self.children for m in child.members()))

    def to_wire(self) -> dict[str, Any]:
        return {"worker": self.worker_id, "address": self.address,
                "children": [child.to_wire() for child in self.children]}

    @classmethod
    def from_wire(cls, value: Any, where: str) -> "RelayNode":
        if not isinstance(value, Mapping):
            raise InvalidValue(where, value, "must be an object of worker, address, children")
        worker, address = value.get("worker"), value.get("address")
        for name, field in (("worker", worker), ("address", address)):
            if not isinstance(field, str) or not field:
                raise InvalidValue(f"{where}.{name}", field, "must be a non-empty string")
        return cls(str(worker), str(address), _nodes(value.get("children", ()), f"{where}.children"))


def _nodes(value: Any, where: str) -> tuple[RelayNode, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidValue(where, value, "must be a list of workers")
    return tuple(RelayNode.from_wire(node, f"{where}[{i}]") for i, node in enumerate(value))


def relay_forest(members: Sequence[tuple[str, str]], width: int) -> tuple[RelayNode, ...]:
    """A ``width``-ary heap over ``members`` ((worker id, address), in order): the driver calls
    the first ``width``; member i's children are members width*(i+1) .. width*(i+1)+width-1."""
    width = check_relay_width(width)
    if width == 0:
        raise InvalidValue("control_relay_width", width, "a tree needs at least 2 children a worker")

    def node(index: int) -> RelayNode:
        first = width * (index + 1)
        return RelayNode(*members[index], children=tuple(
            node(child) for child in range(first, min(first + width, len(members)))))

    return tuple(node(index) for index in range(min(width, len(members))))


@attrs.frozen
class RelayRequest:
    """What the relay control carries: the step to run, as ``worker_id``, and to pass on."""

    worker_id: str
    step: str
    body: Mapping[str, Any]
    children: tuple[RelayNode, ...]
    timeout_s: float  # how long this worker's children may take, each with its subtree

    def to_wire(self) -> dict[str, Any]:
        return {"worker": self.worker_id, "step": self.step, "body": dict(self.body),
                "children": [child.to_wire() for child in self.children],
                "timeout_s": self.timeout_s}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> "RelayRequest":
        worker, step, inner, timeout_s = (body.get(k) for k in ("worker", "step", "body", "timeout_s"))
        for name, field in (("worker", worker), ("step", step)):
            if not isinstance(field, str) or not field:
                raise InvalidValue(f"relay.{name}", field, "must be a non-empty string")
        if step == RELAY_CONTROL:
            raise InvalidValue("relay.step", step, "a relay carries another control")
        if not isinstance(inner, Mapping):
            raise InvalidValue("relay.body", inner, "must be a JSON object")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 < timeout_s < float("inf"):
            raise InvalidValue("relay.timeout_s", timeout_s, "must be a finite number > 0")
        return cls(str(worker), str(step), inner, _nodes(body.get("children", ()), "relay.children"),
                   float(timeout_s))


def _failed(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}


def answers_from(handlers: Mapping[str, Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any]]]]
                 ) -> LocalControl:
    """A worker's own answers from its control handlers, as its control would send them: a
    handler's answer with status ok, or status error naming an unknown control or the failure."""
    async def answer(step: str, body: dict[str, Any]) -> dict[str, Any]:
        handler = handlers.get(step)
        if handler is None:
            return _failed(f"unknown control {step!r}; this worker has {sorted(handlers)}")
        try:
            return {"status": "ok", **(await handler(body))}
        except Exception as exc:  # noqa: BLE001 - the answer names it
            return _failed(f"control {step!r} failed: {type(exc).__name__}: {exc}")
    return answer


class ControlRelay:
    """A worker's ``relay`` control: run the step here and pass it on to the children at once;
    answer ``{"relayed": {worker id: its answer}}`` for this worker's whole subtree."""

    def __init__(self, local: LocalControl, peers: PeerControls) -> None:
        self._local = local
        self._peers = peers

    def controls(self) -> dict[str, Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]]]:
        return {RELAY_CONTROL: self.relay}

    async def relay(self, body: Mapping[str, Any]) -> dict[str, Any]:
        request = RelayRequest.from_wire(body)
        own, *subtrees = await asyncio.gather(
            self._local(request.step, dict(request.body)),
            *(self._pass_on(request, child) for child in request.children))
        relayed = {request.worker_id: own}
        for answers in subtrees:
            relayed.update(answers)
        return {"relayed": relayed}

    async def _pass_on(self, request: RelayRequest, child: RelayNode) -> dict[str, Any]:
        """The child's subtree's answers, or its failure and "not reached" below it."""
        wait_s = request.timeout_s
        inner = RelayRequest(child.worker_id, request.step, request.body, child.children,
                             max(_SHORTEST_HOP_S, wait_s - HOP_MARGIN_S))
        call = ControlCall(self._peers(child.worker_id, child.address), RELAY_CONTROL,
                           inner.to_wire())
        try:
            return subtree_answers(await run_control_call(call, wait_s), child)
        except Exception as exc:  # noqa: BLE001 - reported for the child and everyone below it
            return {child.worker_id: _failed(f"the relay to it failed: {type(exc).__name__}: {exc}"),
                    **{below: _failed(f"not reached: the relay through worker "
                                      f"{child.worker_id!r} failed")
                       for below in child.members()[1:]}}


def subtree_answers(answer: Mapping[str, Any], node: RelayNode) -> dict[str, Any]:
    """A relay's answers for exactly the workers of ``node``'s subtree (WireError if not)."""
    relayed = answer.get("relayed")
    if not isinstance(relayed, Mapping):
        raise WireError(f"worker {node.worker_id!r} answered the relay without its answers")
    expected = set(node.members())
    if set(relayed) != expected:
        raise WireError(f"worker {node.worker_id!r} relayed answers for {sorted(relayed)}, "
                        f"not for its subtree {sorted(expected)}")
    return dict(relayed)


def relayed_plan(calls: Sequence[ControlCall], width: int
                 ) -> list[tuple[ControlCall, RelayNode]] | None:
    """The heads' relay calls (each with its subtree) for ``calls``, or None where they go out
    directly: no relay asked, too few workers, more than one step or body, or a worker its
    peers cannot reach."""
    if not width or len(calls) <= width or not calls:
        return None
    first = calls[0]
    if any(c.name != first.name or c.body != first.body for c in calls[1:]):
        return None
    addresses = [c.control.relay_address() for c in calls]
    if any(address is None for address in addresses):
        return None
    controls = {c.worker_id: c.control for c in calls}
    members = [(c.worker_id, str(address)) for c, address in zip(calls, addresses)]
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
    request = RelayRequest(node.worker_id, step, body, node.children,
                           max(_SHORTEST_HOP_S, timeout_s - HOP_MARGIN_S))
    try:
        relayed = subtree_answers(
            await run_control_call(attrs.evolve(head, body=request.to_wire()), timeout_s), node)
    except Exception as exc:  # noqa: BLE001 - the head's failure, and none reached below it
        return {node.worker_id: exc, **{
            below: RefitError(f"{step} not answered: the relay through worker "
                              f"{node.worker_id!r} failed ({type(exc).__name__}: {exc})")
            for below in node.members()[1:]}}
    return {worker: _read_relayed(worker, step, answer) for worker, answer in relayed.items()}


def _read_relayed(worker: str, step: str, answer: Any) -> Mapping[str, Any] | BaseException:
    """A relayed answer as the worker's own control call would have ended."""
    if not isinstance(answer, Mapping):
        return WireError(f"worker {worker!r} control {step!r}: a relayed answer that is not a "
                         f"JSON object: {answer!r:.200}")
    if answer.get("status") == "error":
        return ControlRefused(f"worker {worker!r} control {step!r} refused: "
                              f"{str(answer.get('message'))[:500]}")
    return answer
