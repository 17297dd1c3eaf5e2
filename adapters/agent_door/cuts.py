"""NeMo-Gym's generation cuts at the door: ``POST /ng-control/v1/generation-cut`` (Gym's
inventory in, its receipt out; ``core.generation_cut``).

404 while cuts are not enabled by the capture setup, 401 for a missing or wrong bearer token,
400 for a body that is no inventory. A call is held by the door process that decodes it, and
the cut may reach any process, so the process it reaches asks every sibling too (each serves
``/door/sibling/generation-cut`` on a Unix socket of its own in the door's folder) and joins
their answers: a cut costs a round trip to each sibling at the checkpoint, and nothing while
calls decode (measured against keeping progress in the shared store: docs/door.md). Each
holder stages what its calls generated since their last cut and acknowledges their prefixes;
decoding goes on. A call nobody holds (finished, or never here) is a durable failure: it is
regenerated after a restore. The receipt is claimed in the shared store first, so the same
inventory, sent again to any process, gets the same receipt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from rollout_fleet.adapters.agent_door.capture import DoorCapture, LiveCall
from rollout_fleet.adapters.agent_door.door_state import CaptureSettings
from rollout_fleet.adapters.agent_door.render import Renderer
from rollout_fleet.adapters.agent_door.replies import error
from rollout_fleet.adapters.agent_door.requests import parsed_json
from rollout_fleet.adapters.agent_door.siblings import (  # noqa: F401 - the door's names for them
    SOCKET_GLOB, Siblings, sibling_socket,
)
from rollout_fleet.core.cut_prefix import chunk_row, prefix_digest
from rollout_fleet.core.generation_cut import (
    CUT_ROUTE, CutInventory, CutPrefix, DurablePrefix, PrefixAck, receipt,
)
from rollout_fleet.core.token_capture import TokenStaging

logger = logging.getLogger(__name__)
SIBLING_ROUTE = "/door/sibling/generation-cut"
_CLAIM_POLL_S = 0.02
# A multi-byte character spans at most four byte-level tokens: a tail this long shows whether
# the generated text ends inside one (a cut there would restore as a broken character).
_TAIL_TOKENS = 8
WireAcks = dict[str, dict[str, Any]]


class GenerationCuts:
    """The cut routes of one door process, which asks its ``siblings`` for their calls."""

    def __init__(self, capture: DoorCapture, renderer: Renderer, siblings: Siblings) -> None:
        self.capture, self.renderer = capture, renderer
        self._siblings = siblings

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(CUT_ROUTE, self.cut)

    def add_sibling_routes(self, app: web.Application) -> None:
        app.router.add_post(SIBLING_ROUTE, self.sibling)

    async def cut(self, request: web.Request) -> web.Response:
        settings, _version = await self.capture.settings()
        if settings is None or not settings.cuts_enabled:
            return error("generation-prefix cuts are disabled", 404)
        bearer = request.headers.get("Authorization", "")
        scheme, _, token = bearer.partition(" ")
        if scheme.lower() != "bearer" or not settings.cut_token_matches(token.strip()):
            return error("invalid control bearer", 401)
        inventory = CutInventory.from_wire(parsed_json(await request.read()))
        deadline = time.monotonic() + settings.cut_timeout_s
        claimed = await self._claim(inventory, settings, deadline)
        if claimed is not None:
            return web.json_response(claimed)
        shared = self.capture.shared
        assert shared is not None  # cuts are enabled only by a setup kept there
        key = (inventory.checkpoint_id, inventory.inventory_digest)
        answer: dict[str, Any] | None = None
        try:
            answer = receipt(inventory, await self.all_acks(inventory, settings, deadline))
        finally:
            await shared.run(shared.state.finish_cut, *key, answer)
        return web.json_response(answer)

    async def _claim(self, inventory: CutInventory, settings: CaptureSettings,
                     deadline: float) -> dict[str, Any] | None:
        """None where this process cuts the inventory; else the receipt another one gave."""
        shared = self.capture.shared
        assert shared is not None
        while True:
            claim, done = await shared.run(
                shared.state.claim_cut, inventory.checkpoint_id, inventory.inventory_digest,
                time.time(), settings.cut_timeout_s)
            if claim == "ours":
                return None
            if claim == "done":
                return done
            if time.monotonic() > deadline:
                raise web.HTTPServiceUnavailable(text="the same inventory is being cut by "
                                                      "another door process")
            await asyncio.sleep(_CLAIM_POLL_S)

    async def all_acks(self, inventory: CutInventory, settings: CaptureSettings,
                       deadline: float) -> WireAcks:
        """The acknowledgements of every call held by this process or a sibling."""
        here, held = await asyncio.gather(
            self.cut_here(inventory, settings),
            self._siblings.ask_all(SIBLING_ROUTE, inventory.to_wire(), deadline))
        acks: WireAcks = dict(here)
        for answer in held:
            acks.update({ticket: ack for ticket, ack in (answer.get("acks") or {}).items()
                         if isinstance(ack, dict)})
        return acks

    async def sibling(self, request: web.Request) -> web.Response:
        """A sibling's cut: the acknowledgements of the calls this process holds."""
        settings, _version = await self.capture.settings()
        if settings is None or not settings.cuts_enabled:
            return web.json_response({"acks": {}})
        inventory = CutInventory.from_wire(parsed_json(await request.read()))
        return web.json_response({"acks": await self.cut_here(inventory, settings)})

    async def cut_here(self, inventory: CutInventory, settings: CaptureSettings) -> WireAcks:
        """Cut each call of ``inventory`` this process holds (at once, each in its turn)."""
        held = [(prefix, live) for prefix in inventory.active_prefixes
                if (live := self.capture.live.get(prefix.model_call_id)) is not None]
        if not held:
            return {}
        staging = await self.capture.staging(settings)
        acks = await asyncio.gather(*(self._cut_call(prefix, live, inventory.checkpoint_id,
                                                     staging) for prefix, live in held))
        return {ack.call.ticket_id: ack.to_wire() for ack in acks}

    async def _cut_call(self, prefix: CutPrefix, live: LiveCall, checkpoint_id: str,
                        staging: TokenStaging) -> PrefixAck:
        call = live.call
        if call.admission.rollout_id != prefix.capture_key:
            logger.warning("cut of call %r: it is captured under %r, the inventory says %r",
                           prefix.model_call_id, call.admission.rollout_id, prefix.capture_key)
            return PrefixAck(prefix)
        async with live.cut_lock:
            frozen = live.progress.freeze()
            if frozen is None:
                return PrefixAck(prefix)
            tokens, logprobs = live.progress.generated(frozen.upto)
            if await self._ends_inside_character(tokens):
                return PrefixAck(prefix)
            key = None
            try:
                if frozen.token_ids:
                    row = chunk_row(call.admission, checkpoint_id, frozen.sequence,
                                    frozen.token_ids, frozen.logprobs, call.weight_version)
                    await self.capture.run(staging.stage, row)
                    key = row.staging_key
                digest = await self.capture.run(prefix_digest, call.admission, call.prefix,
                                                call.weight_version, live.prompt, tokens,
                                                logprobs)
            except Exception as exc:  # a failed cut costs a regeneration, never the call
                logger.warning("cut of call %r failed: %s: %s", prefix.model_call_id,
                               type(exc).__name__, exc)
                return PrefixAck(prefix)
            live.progress.seal(frozen, key)
            return PrefixAck(prefix, DurablePrefix(
                f"active/{checkpoint_id}/{frozen.sequence}", tuple(live.progress.staging_keys),
                len(tokens), digest, live.effective_output_limit))

    async def _ends_inside_character(self, tokens: list[int]) -> bool:
        tail = tokens[-_TAIL_TOKENS:]
        text = await self.renderer.run(lambda t: t.decode(tail))
        return text.endswith("\ufffd")

