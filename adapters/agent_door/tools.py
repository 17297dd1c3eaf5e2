"""The door's other routes: vLLM's ``/tokenize`` and ``/detokenize``, ``/v1/models`` (the
frontend's), ``/health`` (this door process serves), the end of a trajectory, and vLLM's
token-in/token-out ``/inference/v1/generate`` (``generate.py``), its session pinned to the
worker that served it last."""

from __future__ import annotations

import os

from aiohttp import web

from rollout_fleet.adapters.agent_door.generate import (
    SESSION_HEADER, generate_answer, generate_events, generate_request,
)
from rollout_fleet.adapters.agent_door.hop import FrontendHop
from rollout_fleet.adapters.agent_door.prompts import (
    chat_prompt, check_known_vocabulary, check_vocabulary, completion_prompts,
)
from rollout_fleet.adapters.agent_door.records import TurnRecords
from rollout_fleet.adapters.agent_door.render import Renderer
from rollout_fleet.adapters.agent_door.replies import (
    PROMPT_HEADER, WORKER_HEADER, error, passed_on,
)
from rollout_fleet.adapters.agent_door.requests import (
    json_body, known_turns, trajectory_name, with_latest_turn,
)
from rollout_fleet.core.agent_turns import check_trajectory_held
from rollout_fleet.core.errors import HttpStatusError, InvalidValue, WireError
from rollout_fleet.core.validate import is_int
from rollout_fleet.core.wire import (
    completion_body, parse_completion_answer, parse_group_answer,
)

GENERATE = "/inference/v1/generate"


class DoorTools:
    def __init__(self, hop: FrontendHop, renderer: Renderer, records: TurnRecords, *,
                 max_model_len: int) -> None:
        self.hop, self.renderer, self.records = hop, renderer, records
        self.max_model_len = max_model_len
        self.template = renderer.template

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_delete("/v1/trajectories/{name}", self.end_trajectory)
        app.router.add_post(GENERATE, self.generate)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a chat's prompt (``messages``: as a chat turn would be sent,
        earlier turns' exact tokens spliced in) or a completion's (``prompt``)."""
        body = await json_body(request)
        headers = {}
        if "messages" in body:
            trajectory = trajectory_name(request, body)
            messages, roles, known = known_turns(body)
            check_known_vocabulary(known, await self.renderer.vocab_size())
            latest = await self.records.latest(trajectory)
            check_trajectory_held(trajectory, latest, roles, known)
            known = with_latest_turn(latest, known, roles)
            add_generation_prompt = body.get("add_generation_prompt", True)
            if not isinstance(add_generation_prompt, bool):
                raise InvalidValue("add_generation_prompt", add_generation_prompt,
                                   "must be true or false")
            tokens = await self.renderer.run(lambda t: chat_prompt(
                t, body, messages, known, add_generation_prompt=add_generation_prompt))
            if trajectory is None and not known and "assistant" in roles:
                headers[PROMPT_HEADER] = "re-rendered"
        else:
            prompts = await self.renderer.run(lambda t: completion_prompts(t, body))
            if len(prompts) != 1:
                raise InvalidValue("prompt", f"{len(prompts)} prompts", "one prompt")
            tokens = prompts[0]
        return web.json_response({"count": len(tokens), "max_model_len": self.max_model_len,
                                  "tokens": tokens, "token_strs": None}, headers=headers)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise InvalidValue("tokens", tokens, "must be a list of token IDs")
        check_vocabulary("tokens", tokens, await self.renderer.vocab_size())
        return web.json_response({"prompt": await self.renderer.run(lambda t: t.decode(tokens))})

    async def models(self, _request: web.Request) -> web.Response:
        return passed_on(await self.hop.get("/v1/models"))

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy", "door_pid": os.getpid()})

    async def end_trajectory(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        return web.json_response({"trajectory": name, "ended": await self.records.end(name)})

    async def generate(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        model = self.template.served_model_name
        rollout = generate_request(body, model=model, max_model_len=self.max_model_len,
                                   vocab_size=await self.renderer.vocab_size())
        session = request.headers.get(SESSION_HEADER) or None
        sent = completion_body(rollout, model)
        sent["nvext"]["extra_fields"].append("worker_id")
        answered = await self.hop.post("/v1/completions", sent,
                                       pinned=await self.records.pinned_worker(session))
        if answered.status != 200:
            return passed_on(answered)
        try:
            samples = parse_group_answer(answered.body, rollout.n) if rollout.n > 1 else \
                (parse_completion_answer(answered.body),)
        except HttpStatusError as exc:  # a worker's refusal, carried in its answer
            return error(str(exc), exc.status)
        except WireError as exc:
            return error(f"the worker's answer was unreadable: {exc}", 502)
        worker = ((answered.json().get("nvext") or {}).get("worker_id") or {}).get(
            "decode_worker_id")
        headers = {}
        if is_int(worker):
            headers[WORKER_HEADER] = str(worker)
            if session is not None:
                await self.records.pin(session, worker)
        answer = generate_answer(rollout, samples, model=model,
                                 return_token_ids=bool(body.get("return_token_ids")))
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return web.Response(body=generate_events(answer, include_usage=usage),
                                content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", **headers})
        return web.json_response(answer, headers=headers)
