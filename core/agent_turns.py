"""Token-exact turns of an agent's trajectory (pure).

A turn's prompt is the earlier turn's exact tokens (its prompt and what the model generated)
followed by the tokens of what the conversation adds after that turn: the chat template's
rendering of the later messages, tokenized on its own. The earlier turn's text is never
tokenized again, so the tokens a trainer trains on are the ones the policy produced.

The join holds only where the template renders the conversation up to and including the
earlier assistant message as a prefix of its rendering of the whole conversation; where it
does not (a template that rewrites earlier turns, e.g. one that drops old reasoning), the
turn is refused naming the message, never re-tokenized silently.

A ``TrajectoryStore`` keeps the token history of named trajectories for clients that send only
text: bounded in number, each evicted when its client ends it or when it idles
(``Trajectories``: in this process's memory; the agent door's SQLite store: shared by its
processes, and kept when one of them dies).
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import VersionRuns, version_runs


# NeMo-Gym's names for a turn's tokens, on the assistant message that answered it.
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class TurnNotJoinable(InvalidValue):
    """An earlier turn's tokens cannot be the prefix of this turn's prompt."""


# TurnTokens' converters, one named function each (a type checker reads their types).
def _ids(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _floats(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(value)


_as_runs = version_runs("weight_versions")


def _runs(value: Any) -> VersionRuns:
    runs: VersionRuns = _as_runs(value)
    return runs


@attrs.frozen
class TurnTokens:
    """One answered turn: its exact prompt, the generated IDs (a stop token the model made
    included), one logprob per generated ID and the weight version that served it."""

    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_ids)
    generation_token_ids: tuple[int, ...] = attrs.field(converter=_ids)
    generation_log_probs: tuple[float, ...] = attrs.field(converter=_floats, default=())
    # The worker's weights when the turn ended (None where the engine is never refit): a turn
    # served after a refit is told apart from the one before it.
    weight_version: int | None = None
    # Each generated token's weights, run-length ((version, n_tokens), ...): a refit that
    # lands mid-turn (a keep-mode refit) splits the turn's tokens between two versions.
    weight_versions: VersionRuns = attrs.field(default=(), converter=_runs)

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + self.generation_token_ids


def joined_prompt(earlier: TurnTokens, earlier_text: str, whole_text: str, *, turn_field: str,
                  end_of_turn: tuple[str, int] | None = None) -> tuple[tuple[int, ...], str]:
    """The prompt's prefix (the earlier turn's exact tokens) and the text that follows it.

    ``earlier_text``: the template's rendering of the conversation through the earlier
    assistant message; ``whole_text``: its rendering of the whole conversation. The caller
    tokenizes the returned text and appends it. ``end_of_turn`` (its text, its ID): the marker
    the template closes an assistant message with; a turn cut short by its token budget never
    generated it, so it is appended to the exact tokens where the template wrote it.
    """
    if not whole_text.startswith(earlier_text):
        at = next((i for i, (a, b) in enumerate(zip(earlier_text, whole_text)) if a != b),
                  min(len(earlier_text), len(whole_text)))
        raise TurnNotJoinable(turn_field, whole_text[max(0, at - 20):at + 20],
                              f"the chat template renders the conversation with this turn "
                              f"changed from character {at} on, so the turn's exact tokens "
                              "cannot be the prompt's prefix")
    prefix = earlier.all_token_ids
    if end_of_turn is not None:
        text, token_id = end_of_turn
        if earlier_text.endswith(text) and (not prefix or prefix[-1] != token_id):
            prefix += (token_id,)
    return prefix, whole_text[len(earlier_text):]


@attrs.frozen
class RecordedTurn:
    """What a trajectory remembers of one answered turn: how many messages its request had,
    their roles (to check the next request continues the same conversation), its tokens and
    the worker that served it (the next turn goes there, where its prefix is cached)."""

    message_count: int
    roles: tuple[str, ...]
    tokens: TurnTokens
    worker: int | None = None  # the Dynamo instance that served it: it holds the prefix


class TrajectoryStore(ABC):
    """Where the door keeps what a later request needs of an earlier one: each named
    trajectory's last turn, and the worker each session is pinned to. Bounded: an entry
    untouched for ``idle_s`` or past ``capacity`` (least recently used first) is forgotten.
    ``now``: the caller's clock, so the rules stay pure."""

    @abstractmethod
    def latest(self, name: str, now: float) -> RecordedTurn | None:
        """The trajectory's last turn; None when it was never recorded or is forgotten."""

    @abstractmethod
    def record(self, name: str, turn: RecordedTurn, now: float) -> None:
        """Keep ``turn`` as the trajectory's last, the most recently used."""

    @abstractmethod
    def end(self, name: str) -> bool:
        """Forget a trajectory its client has finished; False if it was not kept."""

    @abstractmethod
    def pinned_worker(self, session: str, now: float) -> int | None:
        """The worker (Dynamo instance) that served the session last; None if none is kept."""

    @abstractmethod
    def pin(self, session: str, worker: int, now: float) -> None:
        """Send the session's next request to ``worker`` (it holds the session's prefix)."""


def check_store_bounds(capacity: int, idle_s: float) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1 \
            or not idle_s > 0:
        raise InvalidValue("trajectories", (capacity, idle_s), "capacity >= 1, idle_s > 0")


class _Recent:
    """Values by name, the least recently used first, each with when it was last touched."""

    def __init__(self, capacity: int, idle_s: float) -> None:
        self.capacity, self.idle_s = capacity, idle_s
        self._named: collections.OrderedDict[str, tuple[Any, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._named)

    def __contains__(self, name: str) -> bool:
        return name in self._named

    def get(self, name: str, now: float) -> Any:
        self._forget_idle(now)
        kept = self._named.get(name)
        return None if kept is None else kept[0]

    def put(self, name: str, value: Any, now: float) -> None:
        self._forget_idle(now)
        self._named.pop(name, None)
        self._named[name] = (value, now)  # the most recently used last
        while len(self._named) > self.capacity:
            self._named.popitem(last=False)

    def pop(self, name: str) -> bool:
        return self._named.pop(name, None) is not None

    def _forget_idle(self, now: float) -> None:
        while self._named:
            name, (_, touched) = next(iter(self._named.items()))
            if now - touched < self.idle_s:
                return
            del self._named[name]


class Trajectories(TrajectoryStore):
    """The store in this process's memory: named trajectories' latest turns and sessions'
    workers, at most ``capacity`` of each; one untouched for ``idle_s`` is forgotten at the
    next call (the clock's time is passed in: pure)."""

    def __init__(self, capacity: int = 4096, idle_s: float = 600.0) -> None:
        check_store_bounds(capacity, idle_s)
        self.capacity = capacity
        self.idle_s = idle_s
        self._turns = _Recent(capacity, idle_s)
        self._sessions = _Recent(capacity, idle_s)

    def __len__(self) -> int:
        return len(self._turns)

    def __contains__(self, name: str) -> bool:
        return name in self._turns

    def latest(self, name: str, now: float) -> RecordedTurn | None:
        turn: RecordedTurn | None = self._turns.get(name, now)
        return turn

    def record(self, name: str, turn: RecordedTurn, now: float) -> None:
        self._turns.put(name, turn, now)

    def end(self, name: str) -> bool:
        return self._turns.pop(name)

    def pinned_worker(self, session: str, now: float) -> int | None:
        worker: int | None = self._sessions.get(session, now)
        return worker

    def pin(self, session: str, worker: int, now: float) -> None:
        self._sessions.put(session, worker, now)


class TrajectoryNotHeld(InvalidValue):
    """A named trajectory the store no longer holds (forgotten, or never recorded) continued by
    messages that carry no exact tokens of their earlier turns: the door answers 409."""


def check_trajectory_held(name: str | None, latest: RecordedTurn | None, roles: Sequence[str],
                          known: Mapping[int, TurnTokens]) -> None:
    """Refuse, by the trajectory's name, a turn whose earlier assistant turns would have to be
    tokenized again from their text: never done silently."""
    if name is None or latest is not None or known or "assistant" not in roles:
        return
    index = list(roles).index("assistant")
    raise TrajectoryNotHeld(
        "trajectory", name,
        f"the fleet holds no turn of this trajectory (forgotten after idling or past the "
        f"store's capacity, ended, or never recorded), and messages[{index}] is an earlier "
        "assistant turn without its token fields: send that turn's prompt_token_ids and "
        "generation_token_ids on it, or start a new trajectory")


def recorded_turn_applies(turn: RecordedTurn, roles: Sequence[str], field: str) -> int:
    """The index of the assistant message that answers ``turn`` in a request with ``roles``;
    TurnNotJoinable names the message when the request does not continue that turn."""
    index = turn.message_count
    if len(roles) <= index or roles[index] != "assistant":
        raise TurnNotJoinable(f"{field}[{index}]", roles[index] if len(roles) > index else None,
                              f"the trajectory's last turn had {index} messages, so message "
                              f"{index} must be its assistant answer")
    if tuple(roles[:index]) != turn.roles:
        raise TurnNotJoinable(f"{field}[:{index}]", list(roles[:index]),
                              f"the trajectory's last turn had roles {list(turn.roles)}: this "
                              "request does not continue it")
    return index


def token_fields(message: Any) -> TurnTokens | None:
    """An assistant message's own token fields (NeMo-Gym's names), checked; None without."""
    if not isinstance(message, dict) or message.get("generation_token_ids") is None:
        return None
    fields: dict[str, Sequence[Any]] = {}
    for name in TOKEN_FIELDS:
        value = message.get(name, [])
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise InvalidValue(name, value, "must be a list")
        fields[name] = value
    for name in ("prompt_token_ids", "generation_token_ids"):
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in fields[name]):
            raise InvalidValue(name, fields[name], "must be token IDs (ints >= 0)")
    return TurnTokens(fields["prompt_token_ids"], fields["generation_token_ids"],
                      fields["generation_log_probs"])


REQUIRED_PREFIX_FIELD = "required_prefix_token_ids"


def with_required_prefix(known: dict[int, TurnTokens], roles: Sequence[str],
                         required: Any) -> dict[int, TurnTokens]:
    """``known`` (message index -> the exact tokens of that assistant turn) with NeMo-RL's
    ``required_prefix_token_ids`` taken in: the exact tokens of the conversation through its
    last assistant message. Where that message carries its own tokens, the two must agree."""
    if required is None:
        return known
    if isinstance(required, (str, bytes)) or not isinstance(required, Sequence) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in required):
        raise InvalidValue(REQUIRED_PREFIX_FIELD, required, "must be a list of token IDs")
    last = max((i for i, role in enumerate(roles) if role == "assistant"), default=None)
    if last is None:
        raise TurnNotJoinable(REQUIRED_PREFIX_FIELD, f"{len(required)} token IDs",
                              "is the prefix through an assistant message, and the messages "
                              "have none")
    carried = known.get(last)
    if carried is None:
        return {**known, last: TurnTokens(required, ())}
    if carried.all_token_ids != tuple(required):
        raise TurnNotJoinable(REQUIRED_PREFIX_FIELD, f"{len(required)} token IDs",
                              f"differ from the {len(carried.all_token_ids)} prompt and "
                              f"generated IDs messages[{last}] carries")
    return known
