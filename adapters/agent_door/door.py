"""The agent door: OpenAI chat and completions in front of the fleet's Dynamo frontend,
token-exact across the turns of a trajectory.

For each chat request the door renders the conversation with the model's chat template and
tokenizes it itself, in a render thread (``render.py``); where an earlier assistant turn's exact
tokens are known (the message carries NeMo-Gym's ``prompt_token_ids`` / ``generation_token_ids``
/ ``generation_log_probs``, or the client named its trajectory and the door's store holds its
last turn), they are the prompt's prefix and only what follows them is tokenized
(``core.agent_turns``). A named trajectory the store no longer holds, continued by messages
without their tokens, is refused (409) by its name; a conversation with earlier assistant turns
but neither a trajectory nor their tokens is served from its rendering alone, and its answer
says so (``x-rollout-fleet-prompt: re-rendered``). The prompt goes to Dynamo as
``nvext.token_data``: Dynamo still runs the tool-call and reasoning parsers and turns a
``tool_choice`` into structured decoding; the worker returns every generated ID and logprob in
``engine_data`` (the turn-tokens annotation). The answer carries NeMo-Gym's three fields on its
message, and vLLM's ``prompt_token_ids`` / ``token_ids`` when asked ``return_token_ids``
(``answers.py``). A streamed chat turn is relayed chunk by chunk, rewritten the same way; a
turn's tokens are in the store before the client reads the chunk that carries them. A request
for ``n > 1`` samples is served as one rollout group (``groups.py``). A rollout the fleet's own
driver sends (``/v1/completions`` with the rollout annotation) is passed on as its bytes are.
Every prompt is checked first: its IDs inside the vocabulary, its budget inside the context;
and, where the trainer set its sampling profiles, every chat request's sampling is checked
against them (``core.sampling_guard``). A request carrying NeMo-Gym's ``ng_capture`` is a
captured call (``captured.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from rollout_fleet.adapters.agent_door.answers import (
    TurnStream, engine_data, served_by, turn_tokens, write_cached_tokens, write_chat_tokens,
    write_token_id_logprobs,
)
from rollout_fleet.adapters.agent_door.groups import (
    COMPLETIONS_DEFAULT_MAX_TOKENS, chat_answer, completion_answer, group_request, group_size,
    stream_events,
)
from rollout_fleet.adapters.agent_door.capture import DoorCapture
from rollout_fleet.adapters.agent_door.captured import CapturedChat
from rollout_fleet.adapters.agent_door.hop import FrontendHop
from rollout_fleet.adapters.agent_door.prompts import (
    chat_prompt, check_context, check_known_vocabulary, completion_prompts, max_tokens_asked,
)
from rollout_fleet.adapters.agent_door.records import TurnRecords
from rollout_fleet.adapters.agent_door.render import Renderer
from rollout_fleet.adapters.agent_door.replies import PROMPT_HEADER, error, passed_on
from rollout_fleet.adapters.agent_door.requests import (
    TRAJECTORY_FIELD, json_body, known_turns, parsed_json, token_wishes, trajectory_name,
    with_latest_turn,
)
from rollout_fleet.core.agent_turns import RecordedTurn, TurnTokens, check_trajectory_held
from rollout_fleet.core.capture_admission import CAPTURE_FIELD
from rollout_fleet.core.errors import HttpStatusError, InvalidValue, WireError
from rollout_fleet.core.wire import (
    ROLLOUT_ANNOTATION_PREFIX, TURN_TOKENS_ANNOTATION, completion_body, find_annotation,
    parse_group_answer,
)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
Recorder = Callable[[TurnTokens, "int | None"], Awaitable[None]]


class AgentDoor:
    """The chat and completions routes of one door process."""

    def __init__(self, hop: FrontendHop, renderer: Renderer, records: TurnRecords, *,
                 max_model_len: int, capture: DoorCapture | None = None) -> None:
        self.hop, self.renderer, self.records = hop, renderer, records
        self.max_model_len = max_model_len
        self.template = renderer.template
        self.capture = capture or DoorCapture(None, None)
        self.captured = CapturedChat(hop, renderer, records, self.capture, self._capture_prompt,
                                     _with_token_data, max_model_len=max_model_len)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(CHAT, self.chat)
        app.router.add_post(COMPLETIONS, self.completions)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        trajectory = trajectory_name(request, body)
        settings, version = await self.capture.settings()
        profiles = self.capture.sampling(settings)
        if profiles is not None:
            profiles.check(body)
        if CAPTURE_FIELD in body:
            return await self.captured.answer(body, settings, version)
        wants = token_wishes(body)
        messages, roles, known = known_turns(body)
        check_known_vocabulary(known, await self.renderer.vocab_size())
        budget = max_tokens_asked(body)
        if group_size(body) > 1:
            if trajectory is not None:
                raise InvalidValue(TRAJECTORY_FIELD, trajectory,
                                   "a trajectory continues one sample: n must be 1")
            if wants.as_token_ids:
                raise InvalidValue("return_tokens_as_token_ids", True, "is served for n = 1")
            prompt = await self._chat_prompt(body, messages, known, budget)
            return await self._group({**body, "return_token_ids": wants.ids}, prompt, chat=True)
        latest = await self.records.latest(trajectory)
        check_trajectory_held(trajectory, latest, roles, known)
        known = with_latest_turn(latest, known, roles)
        prompt = await self._chat_prompt(body, messages, known, budget)
        headers = {PROMPT_HEADER: "re-rendered"} if trajectory is None and not known \
            and "assistant" in roles else {}
        forward = _with_token_data({**body, "messages": messages, "logprobs": True}, prompt)
        pinned = latest.worker if latest is not None else None

        async def record(tokens: TurnTokens, worker: int | None) -> None:
            if trajectory is not None:
                turn = RecordedTurn(len(messages), tuple(roles), tokens, worker)
                await self.records.record(trajectory, turn)

        if body.get("stream"):
            relay = TurnStream(prompt, body, wants_ids=wants.ids, wants_logprobs=wants.logprobs)
            return await self._relay_stream(request, CHAT, forward, pinned, relay, headers,
                                            record)
        answered = await self.hop.post(CHAT, forward, pinned=pinned)
        if answered.status != 200:
            return passed_on(answered)
        answer = answered.json()
        engine = engine_data(answer)
        tokens, worker = turn_tokens(engine, prompt), served_by(answer, body)
        write_cached_tokens(answer, engine)
        write_chat_tokens(answer, tokens, wants_ids=wants.ids, wants_logprobs=wants.logprobs)
        if wants.as_token_ids and wants.logprobs:
            write_token_id_logprobs(answer["choices"][0], tokens, chat=True)
        await record(tokens, worker)
        return web.json_response(answer, headers=headers)

    async def _chat_prompt(self, body: Mapping[str, Any], messages: list[dict[str, Any]],
                           known: dict[int, TurnTokens], budget: tuple[str, int | None]
                           ) -> list[int]:
        prompt = await self.renderer.run(lambda t: chat_prompt(t, body, messages, known))
        check_context("messages", len(prompt), budget, self.max_model_len)
        return prompt

    async def _capture_prompt(self, body: dict[str, Any]
                              ) -> tuple[list[dict[str, Any]], list[int]]:
        """A captured call's messages and prompt (its admitted prefix spliced in)."""
        messages, _roles, known = known_turns(body)
        check_known_vocabulary(known, await self.renderer.vocab_size())
        return messages, await self._chat_prompt(body, messages, known, max_tokens_asked(body))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = parsed_json(raw)
        if not body.get("stream") and _is_rollout(body):
            return passed_on(await self.hop.post(COMPLETIONS, raw, headers=request.headers))
        if group_size(body) > 1:
            (prompt,) = await self._completion_prompts(body, default_max_tokens=(
                COMPLETIONS_DEFAULT_MAX_TOKENS), single=True)
            return await self._group(body, prompt, chat=False)
        wants = token_wishes(body)
        if body.get("stream") and wants.ids:
            raise InvalidValue("return_token_ids", True, "streamed completions come as the "
                               "frontend sends them: stream false for token IDs (chat turns "
                               "stream them)")
        prompts = await self._completion_prompts(
            body, default_max_tokens=None, single=wants.ids or wants.as_token_ids)
        if body.get("stream"):
            return await self._relay_stream(request, COMPLETIONS, body, None, PassedOn(), {})
        if not (wants.ids or wants.as_token_ids):
            return passed_on(await self.hop.post(COMPLETIONS, body))
        (prompt,) = prompts
        answered = await self.hop.post(COMPLETIONS,
                                       _with_token_data({**body, "prompt": prompt}, None))
        if answered.status != 200:
            return passed_on(answered)
        answer = answered.json()
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
        return web.json_response(answer)

    async def _completion_prompts(self, body: Mapping[str, Any], *,
                                  default_max_tokens: int | None,
                                  single: bool) -> list[list[int]]:
        prompts = await self.renderer.run(lambda t: completion_prompts(t, body))
        if single and len(prompts) != 1:
            raise InvalidValue("prompt", f"{len(prompts)} prompts", "with return_token_ids or "
                               "n > 1, one prompt: a string or a list of token IDs")
        budget = max_tokens_asked(body, default_max_tokens)
        for index, prompt in enumerate(prompts):
            check_context("prompt" if len(prompts) == 1 else f"prompt[{index}]", len(prompt),
                          budget, self.max_model_len)
        return prompts

    async def _group(self, body: Mapping[str, Any], prompt: list[int], *,
                     chat: bool) -> web.Response:
        """``n`` samples of one prompt as one rollout group, answered as ``n`` choices."""
        request = group_request(body, prompt, chat=chat, default_max_tokens=None if chat
                                else COMPLETIONS_DEFAULT_MAX_TOKENS)
        answered = await self.hop.post(
            COMPLETIONS, completion_body(request, self.template.served_model_name))
        if answered.status != 200:
            return passed_on(answered)
        try:
            samples = parse_group_answer(answered.body, request.n)
        except HttpStatusError as exc:  # a worker's refusal, carried in its answer
            return error(str(exc), exc.status)
        except WireError as exc:
            return error(f"the worker's group answer was unreadable: {exc}", 502)
        write = chat_answer if chat else completion_answer
        answer = await self.renderer.run(
            lambda t: write(body, prompt, samples, t.decode, t.token_strings))
        if body.get("stream"):
            return web.Response(body=stream_events(answer, body), content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        return web.json_response(answer)

    async def _relay_stream(self, request: web.Request, path: str, body: dict[str, Any],
                            worker: int | None, relay: "TurnStream | PassedOn",
                            headers: Mapping[str, str], record: Recorder | None = None
                            ) -> web.StreamResponse:
        """A streamed answer: the frontend's events relayed as they come, each rewritten by
        ``relay``; the turn's tokens ``record``-ed before the event that carries them is sent."""
        answer = await self.hop.open_stream(path, body, pinned=worker)
        try:
            if answer.status != 200:
                return web.Response(body=await answer.read(), status=answer.status,
                                    content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache", **headers})
            await response.prepare(request)
            try:
                async for line in answer.content:
                    out = relay.line(line)
                    if record is not None and relay.tokens is not None:
                        await record(relay.tokens, relay.worker)
                        record = None
                    await response.write(out)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # after the first byte
                failure = {"error": {"message": f"the frontend's stream broke: {exc}",
                                     "code": 502}}
                await response.write(f"data: {json.dumps(failure)}\n\n".encode())
            await response.write_eof()
            return response
        finally:
            answer.release()


class PassedOn:
    """A relay that passes each event on as the frontend wrote it (streamed completions)."""

    tokens: TurnTokens | None = None
    worker: int | None = None

    @staticmethod
    def line(line: bytes) -> bytes:
        return line


def _is_rollout(body: Mapping[str, Any]) -> bool:
    """A rollout of the fleet's own driver (the rollout annotation): passed on as it is."""
    nvext = body.get("nvext")
    return isinstance(nvext, dict) and find_annotation(
        nvext.get("annotations"), ROLLOUT_ANNOTATION_PREFIX) is not None


def _with_token_data(body: Mapping[str, Any], prompt: list[int] | None) -> dict[str, Any]:
    nvext = dict(body.get("nvext") or {})
    if prompt is not None:
        nvext["token_data"] = prompt
    nvext["annotations"] = [*(nvext.get("annotations") or []), TURN_TOKENS_ANNOTATION]
    nvext["extra_fields"] = [*(nvext.get("extra_fields") or []), "engine_data", "worker_id"]
    return {**body, "nvext": nvext}
