"""A rollout served as a worker serves it: its annotation decoded, the engine called, the answer
encoded as engine_data (``core.worker_service.serve_annotated_rollout``), from a test's thread."""

import asyncio

from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.wire import encode_rollout_annotation
from rollout_fleet.core.worker_service import serve_annotated_rollout


def serve_annotated(engine, request: RolloutRequest) -> dict:
    return asyncio.run(serve_annotated_rollout(engine, request.prompt_token_ids,
                                               encode_rollout_annotation(request)))
