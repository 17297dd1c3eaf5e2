"""Control calls relayed down a tree of workers, so the driver's work per fan-out stays flat in N.

A fan-out of one step with one body to N workers costs the driver one call per worker (its CPU
per call, N of them, one after the other on its loop). Relayed, the driver calls only the heads
of a ``width``-ary tree over the workers; each worker runs the step itself and, at once, passes
the call on to its children, and answers with its own answer and every answer of its subtree.
The driver's calls per fan-out are at most ``width``; a worker's, at most ``width``; the depth
is about log_width N round trips.

A worker answers for every worker of its subtree: its child's answers as they came, or, for a
child it could not reach, that child's failure and a "not reached" failure for each worker
below it (``NotReached`` at the driver). Nothing is sent twice within one fan-out: a worker
whose relay failed may have run the step, so it is not called again directly; the fan-out
fails naming it, as a direct call's failure would. A caller that leaves the lost workers out
and runs an idempotent step again (the NeMo-RL driver does, adapters/nemo_rl/membership.py)
reaches those below them then.

Only a fan-out of one step with one body, to more workers than ``width``, each reachable by
its peers (``WorkerControl.relay_address``), is relayed; any other goes out directly. The
driver's side is ``core/fanout.py``'s ``run_calls``; this module holds the tree, what a relay
carries, and a worker's side (``ControlRelay``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.core.control import WorkerControl
from rollout_fleet.core.errors import InvalidValue, WireError
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


def child_timeout_s(timeout_s: float) -> float:
    """How long a worker given ``timeout_s`` lets each of its children take."""
    return max(_SHORTEST_HOP_S, timeout_s - HOP_MARGIN_S)


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


def _failed(message: str, *, reached: bool = True) -> dict[str, Any]:
    """A worker's failed answer; ``reached`` False: the call never got to it."""
    return {"status": "error", "message": message, **({} if reached else {"reached": False})}


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
                             child_timeout_s(wait_s))
        peer = self._peers(child.worker_id, child.address)
        try:
            answer = await asyncio.wait_for(  # the channel's own bound later: one reason each time
                peer.call(RELAY_CONTROL, inner.to_wire(), timeout_s=wait_s + 1.0), wait_s)
            return subtree_answers(answer, child)
        except (asyncio.TimeoutError, TimeoutError):
            return self._unreached(child, f"no answer within {wait_s:g} s")
        except Exception as exc:  # noqa: BLE001 - reported for the child and everyone below it
            return self._unreached(child, f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _unreached(child: RelayNode, why: str) -> dict[str, Any]:
        """The child's failure, and "not reached" for every worker below it."""
        return {child.worker_id: _failed(f"the relay to it failed: {why}"),
                **{below: _failed(f"not reached: the relay through worker {child.worker_id!r} "
                                  f"failed", reached=False) for below in child.members()[1:]}}


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
