"""Partial rollouts: cut a rollout in flight, keep what it generated, continue it later.

An aborted rollout comes back with the tokens and logprobs generated so far (finish reason
``abort``). Its continuation is a new request whose prompt is the original prompt plus those
tokens, with the budget that is left; joining the two answers gives the rollout as if it had
never been cut: token IDs, logprobs and per-token weight versions of both parts, in order.

What is the same as an uncut rollout: greedy tokens (the continuation's prefill sees exactly the
tokens the cut rollout saw). What is not: a seeded sampled rollout draws from a fresh generator
after the cut, and a stop string that straddles the cut is not seen (each part checks its own
text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_fleet.core.control import WorkerControl
from rollout_fleet.core.fanout import call_everywhere
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import (
    FinishReason,
    RolloutRequest,
    RolloutResult,
    join_version_runs,
)

ABORT_CONTROL = "abort_rollout"


def continuation_request(request: RolloutRequest, partial: RolloutResult,
                         request_id: str | None = None) -> RolloutRequest:
    """The request that generates the rest of ``request`` after ``partial`` (an aborted answer).

    Its id defaults to ``<id>+<tokens kept>``: one per cut, so a retry of the continuation is
    told apart from new work.
    """
    if partial.finish_reason is not FinishReason.ABORT:
        raise InvalidValue("partial.finish_reason", partial.finish_reason.value,
                           "only an aborted rollout is continued")
    kept = len(partial.token_ids)
    if kept >= request.max_new_tokens:
        raise InvalidValue("partial.token_ids", f"{kept} tokens",
                           f"leave no budget to continue (max_new_tokens={request.max_new_tokens})")
    return RolloutRequest(
        request_id=request_id or f"{request.request_id}+{kept}",
        prompt_token_ids=request.prompt_token_ids + partial.token_ids,
        max_new_tokens=request.max_new_tokens - kept,
        sampling=request.sampling,
        stop_strings=request.stop_strings,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
    )


def join_rollouts(partial: RolloutResult, rest: RolloutResult) -> RolloutResult:
    """One answer from a cut rollout and its continuation; it ends the way ``rest`` ended."""
    return RolloutResult(
        request_id=partial.request_id,
        token_ids=partial.token_ids + rest.token_ids,
        logprobs=(None if partial.logprobs is None or rest.logprobs is None
                  else partial.logprobs + rest.logprobs),
        finish_reason=rest.finish_reason,
        routed_experts=_joined_experts(partial.routed_experts, rest.routed_experts),
        weight_version=rest.weight_version,
        attempts=partial.attempts + rest.attempts,
        weight_versions=join_version_runs(partial.weight_versions, rest.weight_versions),
    )


async def abort_everywhere(controls: Sequence[WorkerControl], request_id: str,
                           timeout_s: float = 30.0) -> list[str]:
    """Ask every worker (its control channel) to abort ``request_id``; the worker serving it answers the rollout's
    own request with what it generated so far. Returns the ids of the workers that had it in
    flight (none when it finished first, or has not reached a worker yet: a worker remembers an
    early abort and ends the rollout as soon as it arrives)."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidValue("request_id", request_id, "must be a non-empty string")
    answers: Mapping[str, Mapping[str, Any]] = await call_everywhere(
        controls, ABORT_CONTROL, {"request_id": request_id}, timeout_s)
    return [worker for worker, answer in answers.items() if answer.get("was_in_flight")]


def _joined_experts(first: Any, second: Any) -> Any:
    """MoE engines' per-token expert choices of both parts (passed through as they came)."""
    if first is None or second is None:
        return second if first is None else first
    return list(first) + list(second)
