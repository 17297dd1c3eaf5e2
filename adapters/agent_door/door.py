"""The agent door: OpenAI chat and completions for agent clients, in front of the fleet's
Dynamo frontend, token-exact across the turns of a trajectory.

For each chat request the door renders the conversation with the model's chat template and
tokenizes it itself; where an earlier assistant turn's exact tokens are known (the message
carries NeMo-Gym's ``prompt_token_ids`` / ``generation_token_ids`` / ``generation_log_probs``,
or the client named its trajectory and the door kept that trajectory's last turn), they are
the prompt's prefix and only what follows them is tokenized (``core.agent_turns``). The
prompt goes to Dynamo as ``nvext.token_data``: Dynamo still runs the tool-call and reasoning
parsers and turns a ``tool_choice`` into structured decoding; the worker returns every
generated ID and logprob in ``engine_data`` (the turn-tokens annotation). The answer carries
NeMo-Gym's three fields on its message, and vLLM's ``prompt_token_ids`` / ``token_ids`` when
the request asks ``return_token_ids`` (``answers.py``). A streamed chat turn is relayed chunk by
chunk, rewritten the same way; a streamed completion is relayed as the frontend writes it. A
request for ``n > 1`` samples is served as one rollout group (``groups.py``). What a request
asks (its trajectory, its token fields, its messages' known tokens) is read in ``requests.py``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from rollout_fleet.adapters.agent_door.groups import (
    COMPLETIONS_DEFAULT_MAX_TOKENS, chat_answer, completion_answer, group_request, group_size,
    stream_events,
)
from rollout_fleet.adapters.agent_door.answers import (
    TurnStream, engine_data, served_by, turn_tokens, write_cached_tokens, write_chat_tokens,
    write_token_id_logprobs,
)
from rollout_fleet.adapters.agent_door.template import ChatTemplate
from rollout_fleet.adapters.agent_door.requests import (
    TRAJECTORY_FIELD, json_body, known_turns, token_wishes, trajectory_name, with_latest_turn,
)
from rollout_fleet.core.agent_turns import RecordedTurn, Trajectories, TurnTokens, joined_prompt
from rollout_fleet.core.clock import Clock, SystemClock
from rollout_fleet.core.errors import HttpStatusError, InvalidValue, WireError
from rollout_fleet.core.wire import TURN_TOKENS_ANNOTATION, completion_body, parse_group_answer

logger = logging.getLogger(__name__)


class AgentDoor:
    """The door's routes over one fleet frontend (``frontend_url``)."""

    def __init__(self, frontend_url: str, template: ChatTemplate, *,
                 trajectories: Trajectories | None = None, clock: Clock | None = None) -> None:
        self.frontend_url = frontend_url.rstrip("/")
        self.template = template
        self.trajectories = trajectories or Trajectories()
        self.clock = clock or SystemClock()
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_delete("/v1/trajectories/{name}", self.end_trajectory)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.on_cleanup.append(self._close)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
            trajectory = trajectory_name(request, body)
            wants = token_wishes(body)
            messages, roles, known = known_turns(body)
            if group_size(body) > 1:
                if trajectory is not None:
                    raise InvalidValue(TRAJECTORY_FIELD, trajectory,
                                       "a trajectory continues one sample: n must be 1")
                if wants.as_token_ids:
                    raise InvalidValue("return_tokens_as_token_ids", True, "is served for n = 1")
                return await self._group({**body, "return_token_ids": wants.ids},
                                         self._prompt(body, messages, known), chat=True)
            latest = self._latest(trajectory)
            known = with_latest_turn(latest, known, roles)
            prompt = self._prompt(body, messages, known)
        except InvalidValue as exc:
            return _refusal(exc)
        forward = _with_token_data({**body, "messages": messages, "logprobs": True}, prompt)
        pinned = latest.worker if latest is not None else None
        if body.get("stream"):
            relay = TurnStream(prompt, body, wants_ids=wants.ids, wants_logprobs=wants.logprobs)
            response = await self._relay_stream(request, forward, pinned, relay)
            if trajectory is not None and relay.tokens is not None:
                self._record(trajectory, messages, roles, relay.tokens, relay.worker)
            return response
        status, answer = await self._forward_to_worker(forward, pinned)
        if status != 200:
            return web.json_response(answer, status=status)
        engine = engine_data(answer)
        tokens, worker = turn_tokens(engine, prompt), served_by(answer, body)
        write_cached_tokens(answer, engine)
        write_chat_tokens(answer, tokens, wants_ids=wants.ids, wants_logprobs=wants.logprobs)
        if wants.as_token_ids and wants.logprobs:
            write_token_id_logprobs(answer["choices"][0], tokens, chat=True)
        if trajectory is not None:
            self._record(trajectory, messages, roles, tokens, worker)
        return web.json_response(answer)

    def _record(self, trajectory: str, messages: list[dict[str, Any]], roles: list[str],
                tokens: TurnTokens, worker: int | None) -> None:
        self.trajectories.record(trajectory,
                                 RecordedTurn(len(messages), tuple(roles), tokens, worker),
                                 self.clock.monotonic())

    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
            if group_size(body) > 1:
                return await self._group(body, self._completion_prompt(body), chat=False)
            wants = token_wishes(body)
            if body.get("stream") and wants.ids:
                raise InvalidValue("return_token_ids", True, "streamed completions come as the"
                                   " frontend sends them: stream false for token IDs (chat"
                                   " turns stream them)")
        except InvalidValue as exc:
            return _refusal(exc)
        if body.get("stream"):
            return await self._relay_stream(request, body, None, PassedOn(),
                                            path="/v1/completions")
        if not (wants.ids or wants.as_token_ids):
            status, answer = await self._forward("/v1/completions", body)
            return web.json_response(answer, status=status)
        try:
            prompt = self._completion_prompt(body)
        except InvalidValue as exc:
            return _refusal(exc)
        status, answer = await self._forward(
            "/v1/completions", _with_token_data({**body, "prompt": prompt}, None))
        if status == 200:
            engine = engine_data(answer)
            tokens = turn_tokens(engine, prompt)
            write_cached_tokens(answer, engine)
            served_by(answer, body)
            choice = answer["choices"][0]
            if wants.ids:
                choice["prompt_token_ids"] = list(tokens.prompt_token_ids)
                choice["token_ids"] = list(tokens.generation_token_ids)
            if wants.as_token_ids:
                write_token_id_logprobs(choice, tokens, chat=False)
        return web.json_response(answer, status=status)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a chat's prompt (``messages``: as a chat turn would be sent,
        earlier turns' exact tokens spliced in) or a completion's (``prompt``)."""
        try:
            body = await json_body(request)
            if "messages" in body:
                trajectory = trajectory_name(request, body)
                messages, roles, known = known_turns(body)
                known = with_latest_turn(self._latest(trajectory), known, roles)
                add_generation_prompt = body.get("add_generation_prompt", True)
                if not isinstance(add_generation_prompt, bool):
                    raise InvalidValue("add_generation_prompt", add_generation_prompt,
                                       "must be true or false")
                tokens = self._prompt(body, messages, known,
                                      add_generation_prompt=add_generation_prompt)
            else:
                tokens = self._completion_prompt(body)
        except InvalidValue as exc:
            return _refusal(exc)
        return web.json_response({"count": len(tokens), "tokens": tokens, "token_strs": None})

    def _completion_prompt(self, body: Mapping[str, Any]) -> list[int]:
        """The one prompt of a completions request the door tokenizes (or takes as IDs)."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = self.template.encode(prompt, special_tokens=True)
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidValue("prompt", body.get("prompt"), "with return_token_ids or n > 1, "
                               "one prompt: a string or a list of token IDs")
        return prompt

    async def _group(self, body: Mapping[str, Any], prompt: list[int], *,
                     chat: bool) -> web.Response:
        """``n`` samples of one prompt as one rollout group, answered as ``n`` choices."""
        request = group_request(body, prompt, chat=chat, default_max_tokens=None if chat
                                else COMPLETIONS_DEFAULT_MAX_TOKENS)
        sent = completion_body(request, self.template.served_model_name)
        status, text = await self._forward_text("/v1/completions", sent)
        if status != 200:
            return web.Response(text=text, status=status, content_type="application/json")
        try:
            samples = parse_group_answer(text, request.n)
        except HttpStatusError as exc:  # a worker's refusal, carried in its answer
            return _error(str(exc), exc.status)
        except WireError as exc:
            return _error(f"the worker's group answer was unreadable: {exc}", 502)
        write = chat_answer if chat else completion_answer
        answer = write(body, prompt, samples, self.template.decode, self.template.token_strings)
        if body.get("stream"):
            return web.Response(body=stream_events(answer, body), content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        return web.json_response(answer)

    async def end_trajectory(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        return web.json_response({"trajectory": name, "ended": self.trajectories.end(name)})

    async def models(self, request: web.Request) -> web.Response:
        async with self._client().get(f"{self.frontend_url}/v1/models") as answer:
            return web.json_response(await answer.json(content_type=None), status=answer.status)

    # -- the prompt ----------------------------------------------------------------------------
    def _latest(self, trajectory: str | None) -> RecordedTurn | None:
        """The trajectory's last turn; None for its first (or one forgotten: its prompt is
        then rendered afresh)."""
        if trajectory is None:
            return None
        return self.trajectories.latest(trajectory, self.clock.monotonic())

    def _prompt(self, body: Mapping[str, Any], messages: list[dict[str, Any]],
                known: dict[int, TurnTokens], *, add_generation_prompt: bool = True) -> list[int]:
        tools = None if body.get("tool_choice") == "none" else body.get("tools")
        render = dict(tools=tools, template_kwargs=body.get("chat_template_kwargs"))
        whole = self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                     **render)
        if not known:
            return self.template.encode(whole)
        index = max(known)
        earlier = self.template.render(messages[:index + 1], add_generation_prompt=False, **render)
        prefix, rest = joined_prompt(known[index], earlier, whole, turn_field=f"messages[{index}]",
                                     end_of_turn=self.template.end_of_turn)
        return list(prefix) + self.template.encode(rest)

    # -- the frontend --------------------------------------------------------------------------
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def _forward_to_worker(self, body: dict[str, Any],
                                 worker: int | None) -> tuple[int, Any]:
        """A trajectory's turn to the worker that served its last one (Dynamo's own pin,
        ``backend_instance_id``), which holds its prefix in its KV cache; where that worker
        cannot serve it (gone, or failing), once more to whichever the router picks: the
        prefix is then recomputed, and nothing is lost."""
        if worker is None:
            return await self._forward("/v1/chat/completions", body)
        pinned = {**body, "nvext": {**body["nvext"], "backend_instance_id": worker}}
        status, answer = await self._forward("/v1/chat/completions", pinned)
        if _worker_could_not_serve(status):
            logger.info("worker %s did not serve a pinned turn (%s); routing it afresh", worker,
                        status)
            return await self._forward("/v1/chat/completions", body)
        return status, answer

    async def _relay_stream(self, request: web.Request, body: dict[str, Any],
                            worker: int | None, relay: "TurnStream | PassedOn", *,
                            path: str = "/v1/chat/completions") -> web.StreamResponse:
        """A streamed answer: the frontend's events relayed as they come, each rewritten by
        ``relay``; a turn pinned to ``worker`` first, as a whole turn is."""
        answer = await self._open_stream(path, body, worker)
        try:
            if answer.status != 200:
                return web.Response(text=await answer.text(), status=answer.status,
                                    content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
            await response.prepare(request)
            async for line in answer.content:
                await response.write(relay.line(line))
            await response.write_eof()
            return response
        finally:
            answer.release()

    async def _open_stream(self, path: str, body: dict[str, Any], worker: int | None
                           ) -> aiohttp.ClientResponse:
        url = f"{self.frontend_url}{path}"
        if worker is not None:
            pinned = {**body, "nvext": {**body["nvext"], "backend_instance_id": worker}}
            answer = await self._client().post(url, json=pinned)
            if not _worker_could_not_serve(answer.status):
                return answer
            answer.release()
            logger.info("worker %s did not serve a pinned turn (%s); routing it afresh", worker,
                        answer.status)
        return await self._client().post(url, json=body)

    async def _forward(self, path: str, body: Mapping[str, Any]) -> tuple[int, Any]:
        status, text = await self._forward_text(path, body)
        try:
            return status, json.loads(text)
        except ValueError:
            return status, {"error": {"message": text, "code": status}}

    async def _forward_text(self, path: str, body: Mapping[str, Any]) -> tuple[int, str]:
        async with self._client().post(f"{self.frontend_url}{path}", json=body) as answer:
            return answer.status, await answer.text()

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()


class PassedOn:
    """A relay that passes each event on as the frontend wrote it (streamed completions)."""

    @staticmethod
    def line(line: bytes) -> bytes:
        return line


def _with_token_data(body: Mapping[str, Any], prompt: list[int] | None) -> dict[str, Any]:
    nvext = dict(body.get("nvext") or {})
    if prompt is not None:
        nvext["token_data"] = prompt
    nvext["annotations"] = [*(nvext.get("annotations") or []), TURN_TOKENS_ANNOTATION]
    nvext["extra_fields"] = [*(nvext.get("extra_fields") or []), "engine_data", "worker_id"]
    return {**body, "nvext": nvext}


def _worker_could_not_serve(status: int) -> bool:
    """A pinned turn's answer that sends it to another worker (gone, overloaded, failing)."""
    return status in (404, 408, 429) or status >= 500


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _refusal(exc: InvalidValue) -> web.Response:
    return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error",
                                        "param": exc.field, "code": 400}}, status=400)
