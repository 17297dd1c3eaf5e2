"""The worker's side of a rollout, shared by every serving adapter: annotation in, engine_data out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_fleet.core.engine import EnginePort
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
