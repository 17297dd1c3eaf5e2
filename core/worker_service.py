"""The worker's side of a rollout, shared by every serving adapter: annotation in, engine_data out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_fleet.core.engine import EnginePort
from rollout_fleet.core.errors import AnnotationError, EngineDead, EngineRejected, InvalidValue
from rollout_fleet.core.wire import decode_rollout_annotation, engine_data_of


async def serve_annotated_rollout(engine: EnginePort, prompt_token_ids: Sequence[int],
                                  annotation: str) -> dict[str, Any]:
    """Decode the rollout spec, serve it, and encode the whole answer as engine_data.

    Raises AnnotationError / SpecVersionError for a bad spec, InvalidValue for a bad prompt,
    and whatever the engine raises.
    """
    request = decode_rollout_annotation(annotation).to_request(prompt_token_ids)
    # Only when asked: an engine without the optional keyword still serves every other rollout.
    extra = {"stop_token_ids": request.stop_token_ids} if request.stop_token_ids else {}
    served = await engine.serve_rollout(
        request.prompt_token_ids,
        request_id=request.request_id,
        max_new_tokens=request.max_new_tokens,
        sampling=request.sampling,
        stop_strings=request.stop_strings,
        **extra,
    )
    return engine_data_of(served)


def status_of_engine_error(error: BaseException) -> int:
    """The HTTP status a worker's failure to serve a rollout reaches the client as, the same
    for every serving adapter and fake: 400 for a request it refuses (never retried), 503 for
    an engine that died (retried on another worker), 500 for any other failure (retried)."""
    if isinstance(error, EngineDead):
        return 503
    if isinstance(error, AnnotationError | InvalidValue | EngineRejected):
        return 400
    return 500
