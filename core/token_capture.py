"""NeMo-Gym's worker-owned token capture, served by the fleet: each chat turn of an agent's
trajectory is staged, token-exact, before its answer goes back, and the answer carries only
the coordinates of what was staged (``ng_commit_coords``), never the tokens.

Per turn, a door calls ``TokenCapture.admit`` with the request's ``ng_capture`` (before it
renders the prompt: a continuation's prompt must begin with the admitted prefix), then
``complete`` with the tokens the engine saw and generated, then ``answer_with_coords`` on the
answer it sends. The row goes to a ``TokenStaging`` (NeMo-RL's TransferQueue partition, in
production), from which NeMo-RL's finalizer reads it by its staging key.

A turn is stamped with the rollout weight version in force when it was admitted (what
``set_rollout_weight_version`` set last), even if a refit lands before it completes. A turn
that cannot be staged answers ``capture_failed`` coordinates: the completion itself never
fails because of capture (Gym then drops the trajectory from training).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from rollout_fleet.core.agent_turns import TOKEN_FIELDS
from rollout_fleet.core.capture_admission import CAPTURE_FIELD, CaptureAdmission, CaptureRefused
from rollout_fleet.core.capture_records import CommitCoords, StagedRow, build_row
from rollout_fleet.core.errors import InvalidValue, RolloutFleetError

COORDS_FIELD = "ng_commit_coords"
# Where an OpenAI chat answer carries tokens, logprobs or routes; none reaches the agent.
_ANSWER_TOKEN_FIELDS = ("prompt_token_ids", "prompt_logprobs")
_CHOICE_TOKEN_FIELDS = ("logprobs", "token_ids")
_MESSAGE_TOKEN_FIELDS = (*TOKEN_FIELDS, "routed_experts")


class TokenStaging(ABC):
    """Port: where captured rows are made durable, keyed by ``StagedRow.staging_key``, until
    the trainer's finalizer consumes them. Methods block (a door calls them off its event
    loop); they may be called from several threads at once."""

    @abstractmethod
    def stage(self, row: StagedRow) -> None:
        """Make ``row`` durable; return only once it is (a row staged again under the same
        key replaces the first). Raises on failure, and then nothing is promised."""

    @abstractmethod
    def rows(self, keys: Sequence[str]) -> list[StagedRow]:
        """The rows under ``keys``, in that order, exactly as staged (float32 columns
        included). A key without a row raises ``StagedRowMissing`` naming it."""

    @abstractmethod
    def prefix(self, staging_chain: Sequence[str], *,
               parent_chain_hash: str | None = None) -> list[int]:
        """The concatenated deltas of the chain's rows (root first), checked link by link
        (``core.capture_records.join_chain``); given ``parent_chain_hash``, the chain must end
        there. A missing row raises ``StagedRowMissing``, a broken link
        ``StagingChainBroken``, each naming the key and its place in the chain."""

    @abstractmethod
    def clear(self, keys: Sequence[str]) -> None:
        """Drop the rows under ``keys``; keys without a row are ignored."""


class CallAlreadyCompleted(RolloutFleetError):
    """A captured call was completed (or failed) twice: each call stages at most one row."""


class WeightVersionSource:
    """The rollout weight version that turns are stamped with: what
    ``set_rollout_weight_version`` set last (0 until then). Thread safe."""

    def __init__(self, version: int = 0) -> None:
        self._lock = threading.Lock()
        self._version = 0
        self.set(version)

    def set(self, version: int) -> None:
        if type(version) is not int or version < 0:
            raise InvalidValue("version", version, "a rollout weight version is an integer >= 0")
        with self._lock:
            self._version = version

    def __call__(self) -> int:
        with self._lock:
            return self._version


@attrs.define(eq=False)
class CaptureCall:
    """One admitted call: its admission, the weight version stamped when it was admitted and
    the exact prefix its prompt must begin with. Completed once."""

    admission: CaptureAdmission
    weight_version: int
    prefix: tuple[int, ...]
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _claimed: bool = attrs.field(default=False, init=False)

    def claim(self) -> None:
        """Mark the call completed; a second claim raises ``CallAlreadyCompleted``."""
        with self._lock:
            if self._claimed:
                raise CallAlreadyCompleted(f"call {self.admission.staging_key!r} was already "
                                           "completed")
            self._claimed = True


class TokenCapture:
    """The capture of one worker's turns, staged through ``staging``; ``weight_version``
    gives the rollout weight version in force (a ``WeightVersionSource``, usually)."""

    def __init__(self, staging: TokenStaging, weight_version: Callable[[], int]) -> None:
        self._staging = staging
        self._weight_version = weight_version

    def admit(self, ng_capture: Mapping[str, Any] | CaptureAdmission,
              prefix: Sequence[int] | None = None, *, stream: bool = False) -> CaptureCall:
        """Admit one call: ``ng_capture`` parsed and checked (``CaptureRefused`` names the
        field at fault), its prefix resolved and the weight version stamped. ``prefix`` is
        the prefix a caller already read back for a staging-chain admission; without it the
        chain is read here, from staging (blocking: ``StagedRowMissing`` or
        ``StagingChainBroken`` where the chain cannot give it, ``StagingUnavailable`` where
        staging does not answer). Streaming requests are refused: a turn is staged whole."""
        admission = ng_capture if isinstance(ng_capture, CaptureAdmission) else \
            CaptureAdmission.from_wire(ng_capture)
        if stream:
            raise CaptureRefused("stream", True, "token capture answers non-streaming requests "
                                                 "only: a turn is staged whole before its answer")
        field = "prefix"
        if prefix is None and admission.staging_chain:
            prefix = self._staging.prefix(admission.staging_chain,
                                          parent_chain_hash=admission.parent_chain_hash)
            field = f"{CAPTURE_FIELD}.staging_chain"
        resolved = admission.resolve_prefix(prefix, field=field)
        version = self._weight_version()
        if type(version) is not int or version < 0:
            raise InvalidValue("weight_version", version, "the rollout weight version source "
                                                          "must give an integer >= 0")
        return CaptureCall(admission, version, resolved)

    def complete(self, call: CaptureCall, prompt_token_ids: Sequence[int],
                 generated_token_ids: Sequence[int],
                 generated_logprobs: Sequence[float]) -> CommitCoords:
        """Stage the turn's row, then return its coordinates; ``prompt_token_ids`` are the
        tokens the engine saw (the whole conversation), the others what it generated. A turn
        that breaks the admission (a prompt not beginning with the prefix) or that staging
        does not take gives ``capture_failed`` coordinates, whose ``failure`` says why."""
        call.claim()
        try:
            row = build_row(call.admission, call.prefix, call.weight_version, prompt_token_ids,
                            generated_token_ids, generated_logprobs)
        except (ValueError, TypeError, OverflowError) as refused:  # InvalidValue, mostly
            return self._failed(call, f"the turn cannot be captured: {refused}")
        try:
            self._staging.stage(row)
        except Exception as error:  # any store's failure: capture fails, the answer does not
            return self._failed(call, f"staging failed: {type(error).__name__}: {error}")
        return CommitCoords.staged(row)

    def fail(self, call: CaptureCall, reason: str) -> CommitCoords:
        """``capture_failed`` coordinates for a call that ends without a turn to stage."""
        call.claim()
        return self._failed(call, reason)

    def clear(self, keys: Sequence[str]) -> None:
        self._staging.clear(keys)

    @staticmethod
    def _failed(call: CaptureCall, reason: str) -> CommitCoords:
        return CommitCoords.capture_failed(call.admission, call.weight_version, reason)


def answer_with_coords(answer: Mapping[str, Any], coords: CommitCoords) -> dict[str, Any]:
    """A chat completion answer as a captured call returns it: every token, logprob and route
    field taken out (the answer's, each choice's and each choice message's), and the commit
    coordinates added under ``ng_commit_coords``. ``answer`` itself is left as it was."""
    stripped = {name: value for name, value in answer.items()
                if name not in _ANSWER_TOKEN_FIELDS and name != COORDS_FIELD}
    if isinstance(answer.get("choices"), list):
        stripped["choices"] = [_stripped_choice(choice) for choice in answer["choices"]]
    stripped[COORDS_FIELD] = coords.to_wire()
    return stripped


def _stripped_choice(choice: Any) -> Any:
    if not isinstance(choice, Mapping):
        return choice
    stripped = {name: value for name, value in choice.items()
                if name not in _CHOICE_TOKEN_FIELDS}
    message = choice.get("message")
    if isinstance(message, Mapping):
        stripped["message"] = {name: value for name, value in message.items()
                               if name not in _MESSAGE_TOKEN_FIELDS}
    return stripped
