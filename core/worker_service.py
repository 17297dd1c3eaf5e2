"""The worker's side of a rollout, shared by every serving adapter: annotation in, engine_data out."""

from __future__ import annotations

from typing import Any

import attrs
from rollout_fleet.core.engine import EnginePort, offered_keywords
from rollout_fleet.core.errors import (
    AnnotationError, EngineAsleep, EngineDead, EngineRejected, InvalidValue,
)
from rollout_fleet.core.rollout import RolloutRequest, ServedRollout, checked_prompt
from rollout_fleet.core.wire import (
    RolloutSpec, decode_rollout_annotation, engine_data_of, group_engine_data_of,
    refused_engine_data,
)


async def serve_annotated_rollout(engine: EnginePort, prompt_token_ids: Any, annotation: str,
                                  *, worker: str | None = None,
                                  offered: frozenset[str] | None = None) -> dict[str, Any]:
    """Decode the rollout spec and check the prompt, as the wire carried them (a worker's
    trust boundary: AnnotationError / SpecVersionError for a bad spec, InvalidValue for a bad
    prompt), then serve them (``serve_rollout_spec``)."""
    spec = decode_rollout_annotation(annotation)
    return await serve_rollout_spec(engine, checked_prompt(prompt_token_ids), spec,
                                    worker=worker, offered=offered)


async def serve_rollout_spec(engine: EnginePort, prompt_token_ids: tuple[int, ...],
                             spec: RolloutSpec, *, worker: str | None = None,
                             offered: frozenset[str] | None = None) -> dict[str, Any]:
    """Serve a rollout whose spec and prompt were checked where they arrived, and encode the
    whole answer as engine_data.

    An engine asleep is answered as a refusal (503) naming ``worker`` and who wakes it, in the
    engine_data (``core.wire.refused_engine_data``): the driver retries it, and when its retries
    give up, that message is its last error. Raises whatever else the engine raises.
    ``offered``: the engine's ``offered_keywords``, where the caller read them once (a
    long-lived worker); else they are read from its signature here.
    """
    if offered is None:
        offered = offered_keywords(engine)
    try:
        return await _serve(engine, spec.to_request(prompt_token_ids), offered)
    except EngineAsleep as asleep:
        return refused_engine_data(status_of_engine_error(asleep), str(asleep.named(worker)))


async def _serve(engine: EnginePort, request: RolloutRequest,
                 offered: frozenset[str]) -> dict[str, Any]:
    # Only when asked: an engine without the optional keyword still serves every other rollout.
    extra: dict[str, Any] = {}
    if request.stop_token_ids:
        extra["stop_token_ids"] = request.stop_token_ids
    if request.ignore_eos:
        extra["extra_sampling"] = {"ignore_eos": True}
    if not request.logprobs and "with_logprobs" in offered:
        extra["with_logprobs"] = False  # the engine need not compute them
    if request.n > 1:  # a group: n samples from one request, on this one worker
        samples = await engine.serve_group(
            request.prompt_token_ids, request_id=request.request_id, n=request.n,
            max_new_tokens=request.max_new_tokens, sampling=request.sampling,
            stop_strings=request.stop_strings, **extra)
        return group_engine_data_of([_as_asked(request, served) for served in samples])
    served = await engine.serve_rollout(
        request.prompt_token_ids,
        request_id=request.request_id,
        max_new_tokens=request.max_new_tokens,
        sampling=request.sampling,
        stop_strings=request.stop_strings,
        **extra,
    )
    return engine_data_of(_as_asked(request, served))


def _as_asked(request: RolloutRequest, served: ServedRollout) -> ServedRollout:
    """Without the logprobs a rollout did not ask for (an engine that computes them anyway):
    every worker answers such a rollout alike, and the wire carries none."""
    if request.logprobs or served.logprobs is None:
        return served
    return attrs.evolve(served, logprobs=None)


def status_of_engine_error(error: BaseException) -> int:
    """The HTTP status a worker's failure to serve a rollout reaches the client as, the same
    for every serving adapter and fake: 400 for a request it refuses (never retried), 503 for
    an engine that died or is asleep (retried, on another worker or once it is woken), 500
    for any other failure (retried)."""
    if isinstance(error, EngineDead | EngineAsleep):
        return 503
    if isinstance(error, AnnotationError | InvalidValue | EngineRejected):
        return 400
    return 500
