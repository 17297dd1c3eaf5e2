"""A chat request carrying NeMo-Gym's ``ng_capture``: a turn whose tokens are staged by the
fleet, never handed to the agent (``core.token_capture``).

The admission is parsed and its prefix resolved once, off the event loop (a staging chain is
read back from staging; a chain that cannot give it is refused by its place); the prefix is
the prompt's start, as the door splices any known turn; the turn is forwarded, and its delta
staged before the answer goes back, stamped with the rollout weight version in force when
the call began. The answer carries ``ng_commit_coords`` and no token field. With generation
cuts served, the door reads the turn from the frontend as a stream and keeps its tokens as
they come (a cut stages them, ``cuts.py``); the client still gets one whole answer. A
restored call's staged prefix follows its prompt, its budget shrinks by as much, and its row
covers the whole generation. A checkpoint's generation fence (``fence.py``) holds a new call
before it is forwarded while frozen, and a finished turn before it is staged until it opens.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import attrs
from aiohttp import web

from rollout_fleet.adapters.agent_door.answers import engine_data, served_by, turn_tokens
from rollout_fleet.adapters.agent_door.capture import DoorCapture, LiveCall
from rollout_fleet.adapters.agent_door.door_state import CaptureSettings
from rollout_fleet.adapters.agent_door.gather import TOKEN_IDS_FIELD, GatheredTurn, StreamBroken
from rollout_fleet.adapters.agent_door.groups import group_size
from rollout_fleet.adapters.agent_door.hop import FrontendHop
from rollout_fleet.adapters.agent_door.prompts import check_context, max_tokens_asked
from rollout_fleet.adapters.agent_door.records import TurnRecords
from rollout_fleet.adapters.agent_door.render import Renderer
from rollout_fleet.adapters.agent_door.replies import error, passed_on
from rollout_fleet.adapters.agent_door.requests import token_wishes
from rollout_fleet.core.agent_turns import REQUIRED_PREFIX_FIELD
from rollout_fleet.core.capture_admission import CAPTURE_FIELD
from rollout_fleet.core.capture_records import StagedRow, StagingChainBroken
from rollout_fleet.core.cut_prefix import CutProgress, RestoredPrefix, restored_prefix
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.generation_cut import CutContinuation, split_continuation
from rollout_fleet.core.token_capture import (
    CaptureCall, TokenCapture, TokenStaging, answer_with_coords,
)

CHAT = "/v1/chat/completions"
# The prompt of a chat body (its messages with the known prefix spliced), and its budget.
PromptOf = Callable[[dict[str, Any]], Awaitable[tuple[list[dict[str, Any]], list[int]]]]
Forward = Callable[[Mapping[str, Any], list[int]], dict[str, Any]]
NOT_SET_UP = ("token capture is not set up on this door: the trainer's setup_token_capture "
              "comes first")


@attrs.frozen
class Turn:
    """One captured call as it is forwarded: its admitted call, the prompt the template gave,
    what the engine is prompted with (a restored prefix after it) and its budget."""

    call: CaptureCall
    prompt: list[int]
    restored: RestoredPrefix | None
    budget: int

    @property
    def engine_prompt(self) -> list[int]:
        return [*self.prompt, *(self.restored.token_ids if self.restored else ())]


class CapturedChat:
    def __init__(self, hop: FrontendHop, renderer: Renderer, records: TurnRecords,
                 capture: DoorCapture, prompt_of: PromptOf, forward: Forward, *,
                 max_model_len: int) -> None:
        self.hop, self.renderer, self.records, self.capture = hop, renderer, records, capture
        self._prompt_of, self._forward = prompt_of, forward
        self.max_model_len = max_model_len

    async def answer(self, body: dict[str, Any], settings: CaptureSettings | None,
                     version: int) -> web.Response:
        if body.get("stream"):
            raise InvalidValue("stream", body["stream"], "a captured call is answered whole "
                                                         "(its turn is staged before its answer)")
        if group_size(body) != 1:
            raise InvalidValue("n", body.get("n"), "a captured call generates one choice")
        if settings is None:
            return error(NOT_SET_UP, 503)
        wire, continuation = split_continuation(body.pop(CAPTURE_FIELD))
        staging = await self.capture.staging(settings)
        capture = TokenCapture(staging, lambda: version)
        call = await self.capture.run(capture.admit, wire)
        turn = await self._turn(body, call, continuation, staging, version)
        await self.capture.fence.hold_new_call()
        pin = f"ng-capture:{call.admission.rollout_id}"
        pinned = await self.records.pinned_worker(pin) if call.admission.prev_len else None
        forward = self._forward({**body, "max_tokens": turn.budget, "logprobs": True},
                                turn.engine_prompt)
        forward.pop("max_completion_tokens", None)
        if settings.cuts_enabled:
            answer = await self._streamed(forward, pinned, turn)
        else:
            answered = await self.hop.post(CHAT, forward, pinned=pinned)
            answer = answered.json() if answered.status == 200 else passed_on(answered)
        if isinstance(answer, web.Response):
            return answer
        worker = served_by(answer, body)
        if worker is not None:
            await self.records.pin(pin, worker)
        return web.json_response(await self._commit(answer, turn, capture))

    async def _turn(self, body: dict[str, Any], call: CaptureCall,
                    continuation: CutContinuation | None, staging: TokenStaging,
                    version: int) -> Turn:
        token_wishes(body)  # the answer carries no token field, whatever was asked
        if call.admission.mode == "token_in":
            given = body.get(REQUIRED_PREFIX_FIELD)
            if given is not None and list(given) != list(call.prefix):
                raise InvalidValue(REQUIRED_PREFIX_FIELD, f"{len(given)} token IDs",
                                   f"differ from the admitted prefix of {len(call.prefix)}")
            body[REQUIRED_PREFIX_FIELD] = list(call.prefix)
        budget = max_tokens_asked(body)
        messages, prompt = await self._prompt_of(body)
        body["messages"] = messages
        limit = self.max_model_len - len(prompt)
        limit = min(limit, budget[1]) if budget[1] is not None else limit
        if continuation is None:
            return Turn(call, prompt, None, limit)
        rows = await self.capture.run(_chunks, staging, continuation.staging_keys)
        restored = await self.capture.run(restored_prefix, continuation, call.admission,
                                          call.prefix, prompt, rows, version)
        call = CaptureCall(call.admission, min(version, restored.weight_version), call.prefix)
        left = continuation.effective_output_limit - len(restored.token_ids)
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - len(restored.token_ids))
        check_context("messages", len(prompt) + len(restored.token_ids), ("max_tokens", left),
                      self.max_model_len)
        return Turn(call, prompt, restored, left)

    async def _streamed(self, forward: dict[str, Any], pinned: int | None,
                        turn: Turn) -> dict[str, Any] | web.Response:
        """The turn read as a stream, its tokens kept as they come for a cut."""
        restored = turn.restored
        inherited = len(restored.token_ids) if restored else 0
        live = LiveCall(turn.call, tuple(turn.prompt), turn.budget + inherited,
                        CutProgress(restored))
        nvext = dict(forward.get("nvext") or {})
        nvext["extra_fields"] = [*(nvext.get("extra_fields") or []), TOKEN_IDS_FIELD]
        streamed = {**forward, "nvext": nvext, "stream": True, "logprobs": True}
        self.capture.live.add(live)
        try:
            answer = await self.hop.open_stream(CHAT, streamed, pinned=pinned)
            try:
                if answer.status != 200:
                    return web.Response(body=await answer.read(), status=answer.status,
                                        content_type="application/json")
                gathered = GatheredTurn(lambda ids, logprobs: _observe(live, ids, logprobs))
                async for line in answer.content:
                    gathered.line(line)
            except (aiohttp.ClientError, TimeoutError, StreamBroken) as exc:
                return error(f"the frontend's stream broke: {exc}", 502)
            finally:
                answer.release()
            live.progress.ended = True
            return gathered.answer(len(turn.engine_prompt), len(live.progress.token_ids))
        finally:
            live.progress.ended = True
            self.capture.live.remove(live)

    async def _commit(self, answer: dict[str, Any], turn: Turn,
                      capture: TokenCapture) -> dict[str, Any]:
        """Stage the turn (the restored prefix and what followed, as one generation), then
        the answer as the agent gets it."""
        tokens = turn_tokens(engine_data(answer), turn.engine_prompt)
        restored = turn.restored
        generated = [*(restored.token_ids if restored else ()), *tokens.generation_token_ids]
        logprobs = [*(restored.logprobs if restored else ()), *tokens.generation_log_probs]
        if tokens.generation_token_ids:
            async with self.capture.fence.terminal_write():
                coords = await self.capture.run(capture.complete, turn.call, turn.prompt,
                                                generated, logprobs)
        else:
            coords = capture.fail(turn.call, "the worker returned no generated token IDs")
        nvext = answer.get("nvext")
        if isinstance(nvext, dict):
            nvext.pop(TOKEN_IDS_FIELD, None)
            if not nvext:
                answer.pop("nvext")
        if restored is not None:
            await self._restore_text(answer, restored)
        served = answer_with_coords(answer, coords)
        served["id"] = served.get("id") or turn.call.admission.model_call_id
        return served

    async def _restore_text(self, answer: dict[str, Any], restored: RestoredPrefix) -> None:
        """A restored call's message begins with its restored prefix's text."""
        text = await self.renderer.run(lambda t: t.decode(list(restored.token_ids)))
        for choice in answer.get("choices") or []:
            message = choice.get("message") or {}
            if isinstance(message.get("content"), str) or message.get("content") is None:
                message["content"] = text + (message.get("content") or "")


def _chunks(staging: TokenStaging, keys: tuple[str, ...]) -> list[StagedRow]:
    try:
        return staging.rows(keys)
    except StagingChainBroken as broken:
        raise InvalidValue(f"{CAPTURE_FIELD}.generation_cut.staging_keys", broken.value,
                           broken.rule) from None


def _observe(live: LiveCall, token_ids: list[int], logprobs: list[Any]) -> None:
    if not all(isinstance(value, (int, float)) for value in logprobs):
        live.progress.broken = "a chunk came without its logprobs"
        return
    live.progress.observe(token_ids, logprobs)
