"""What the door answers besides a served turn: a refusal of the request (400, or 409 for a
trajectory the fleet no longer holds) naming the field and the value, the frontend's own error
passed on with its status, the frontend unreachable (502, 504 past the read deadline), token
staging unavailable or the model's tokenizer not loadable (503). Every route goes through
``door_middleware``, which also names the door process in each answer."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

from aiohttp import web

from rollout_fleet.adapters.agent_door.hop import Answer, FrontendUnreachable
from rollout_fleet.adapters.agent_door.template import TokenizerUnavailable
from rollout_fleet.core.agent_turns import TrajectoryNotHeld
from rollout_fleet.core.capture_records import StagingUnavailable
from rollout_fleet.core.errors import InvalidValue

DOOR_PROCESS_HEADER = "x-rollout-fleet-door"  # the pid of the door process that answered
PROMPT_HEADER = "x-rollout-fleet-prompt"  # "re-rendered": no earlier turn's exact tokens known
WORKER_HEADER = "x-rollout-fleet-worker"  # the Dynamo instance that served a token-in request


def refusal(exc: InvalidValue) -> web.Response:
    status = 409 if isinstance(exc, TrajectoryNotHeld) else 400
    kind = "conflict_error" if status == 409 else "invalid_request_error"
    return web.json_response({"error": {"message": str(exc), "type": kind, "param": exc.field,
                                        "code": status}}, status=status)


def error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def passed_on(answer: Answer) -> web.Response:
    """The frontend's answer as it came (its status and body)."""
    return web.Response(body=answer.body, status=answer.status, content_type="application/json")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def door_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except InvalidValue as exc:  # raised before an answer's first byte: it has its status
        return refusal(exc)
    except FrontendUnreachable as exc:
        return error(str(exc), 504 if exc.timed_out else 502)
    except StagingUnavailable as exc:  # token capture's staging: the trainer's store
        return error(f"token staging is unavailable: {exc}", 503)
    except TokenizerUnavailable as exc:  # what needs no tokenizer is still served
        return error(str(exc), 503)


async def name_the_door_process(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers[DOOR_PROCESS_HEADER] = str(os.getpid())
