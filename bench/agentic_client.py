"""The agentic load's client (bench/bench_agentic.py): trajectories sent as agents send them,
streamed, in client processes of their own so that parsing 1,024 streams does not cap a side.

Three ways to send a turn (``Arm.mode``):

  chat:      the whole message list, each turn (vLLM's server; the fleet's door, where
             ``named`` adds the trajectory's name, so the door continues its exact tokens)
  token-in:  the fleet's frontend straight, as the door would send it: the conversation's exact
             token IDs in ``nvext.token_data`` (the previous turn's prompt and generated IDs,
             then the rest of the template's rendering, tokenized: the door's own
             ``chat_prompt``), the turn-tokens annotation, pinned to the worker that served the
             previous turn

Every turn asks for the sampled tokens' logprobs (the door always asks the worker for them),
``max_tokens`` = ``ignore_eos`` budget, and streams with usage. A share of trajectories runs in
one process (``run_share``), all of its trajectories at once; a turn starts only before the
share's deadline, and the share is cut at its hard deadline.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from agentic_load import LoadShape, TrajectoryPlan, TurnRecord, words_text

CHAT, TOKEN_IN = "chat", "token-in"
_STATE: dict[str, Any] = {}  # this client process's words and chat template (``prepare``)


@dataclass(frozen=True)
class Arm:
    name: str
    url: str  # the server's base URL (no /v1)
    mode: str
    model: str
    named: bool = False  # chat: the trajectory's name in the door's header
    label: str = ""  # the content's seed label: arms on one server must not share content


@dataclass(frozen=True)
class Share:
    arm: Arm
    shape: LoadShape
    plans: tuple[TrajectoryPlan, ...]
    start_at: float  # wall clock: every client process starts its share then
    deadline: float  # no turn starts after it
    hard_deadline: float  # the share is cut here (turns in flight are abandoned)
    trajectory_prefix: str


def prepare(model_path: str, served_model: str, words: list[str]) -> None:
    """A client process's state: the content's words, the chat template (token-in arms)."""
    from rollout_fleet.adapters.agent_door.template import ChatTemplate

    _STATE.update(words=words, template=ChatTemplate(model_path, served_model))


def run_share(share: Share) -> tuple[list[TurnRecord], list[str]]:
    """(turn records, failures) of one client process's trajectories."""
    return asyncio.run(_run_share(share))


async def _run_share(share: Share) -> tuple[list[TurnRecord], list[str]]:
    import aiohttp

    records: list[TurnRecord] = []
    failures: list[str] = []
    await asyncio.sleep(max(0.0, share.start_at - time.time()))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    # A turn's last event carries its exact tokens (the door's token fields): tens of KiB.
    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=2**20,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        runs = [asyncio.ensure_future(_trajectory(http, share, plan, records, failures))
                for plan in share.plans]
        _done, cut = await asyncio.wait(runs, timeout=max(0.0, share.hard_deadline - time.time()))
        for run in cut:
            run.cancel()
        if cut:
            failures.append(f"{len(cut)} trajectories cut at the hard deadline")
            await asyncio.gather(*cut, return_exceptions=True)
    return records, failures


async def _trajectory(http, share: Share, plan: TrajectoryPlan, records: list[TurnRecord],
                      failures: list[str]) -> None:
    shape, arm = share.shape, share.arm
    rng = random.Random(plan.content_seed)
    words = _STATE["words"]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": words_text(words, shape.first_context, rng)}]
    sender = TokenInTurns(_STATE["template"]) if arm.mode == TOKEN_IN else None
    name = f"{share.trajectory_prefix}-{plan.index}"
    earlier = 0
    for turn in range(shape.turns):
        if time.time() >= share.deadline:
            return
        body = {"model": arm.model, "messages": messages, "max_tokens": shape.answer_tokens,
                "ignore_eos": True, "temperature": 1.0, "logprobs": True, "stream": True,
                "stream_options": {"include_usage": True}}
        headers = {"X-Trajectory-Id": name} if arm.named else {}
        if sender is not None:
            body = sender.body(body)
        try:
            answer = await _streamed_turn(http, f"{arm.url}/v1/chat/completions", body, headers)
        except (OSError, asyncio.TimeoutError, RuntimeError, ValueError) as failure:
            failures.append(f"{name} turn {turn + 1}: {type(failure).__name__}: {failure}"[:600])
            return
        prompt_tokens = answer.prompt_tokens if answer.prompt_tokens is not None else (
            sender.prompt_length if sender is not None else 0)
        records.append(TurnRecord(plan.index, turn, answer.ttft_s, answer.latency_s,
                                  prompt_tokens, answer.completion_tokens, answer.cached_tokens,
                                  earlier, time.time()))
        earlier = prompt_tokens + answer.completion_tokens
        if turn + 1 == shape.turns:
            return
        await asyncio.sleep(plan.tool_latencies_s[turn])
        messages = [*messages, {"role": "assistant", "content": answer.text},
                    {"role": "tool", "tool_call_id": f"call-{turn}",
                     "content": words_text(words, shape.tool_result_tokens, rng)}]
        if sender is not None:
            sender.next_prompt(messages, answer)


class TokenInTurns:
    """A token-in trajectory's exact prompt, as the door makes it: the previous turn's prompt
    and generated IDs, then the template's rendering of what followed them, tokenized."""

    def __init__(self, template) -> None:
        self.template = template
        self.prompt: list[int] | None = None
        self.worker: int | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.prompt or ())

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        from rollout_fleet.adapters.agent_door.prompts import chat_prompt
        from rollout_fleet.core.wire import TURN_TOKENS_ANNOTATION

        if self.prompt is None:
            self.prompt = chat_prompt(self.template, body, body["messages"], {})
        nvext: dict[str, Any] = {"token_data": self.prompt,
                                 "annotations": [TURN_TOKENS_ANNOTATION],
                                 "extra_fields": ["engine_data", "worker_id"]}
        if self.worker is not None:
            nvext["backend_instance_id"] = self.worker
        return {**body, "nvext": nvext}

    def next_prompt(self, messages: list[dict[str, Any]], answer: "Answer") -> None:
        from rollout_fleet.adapters.agent_door.answers import turn_tokens
        from rollout_fleet.adapters.agent_door.prompts import chat_prompt

        assert self.prompt is not None
        if not answer.engine_data:
            raise RuntimeError("the frontend's answer carried no engine_data (turn tokens)")
        known = {len(messages) - 2: turn_tokens(answer.engine_data, self.prompt)}
        self.prompt = chat_prompt(self.template, {}, messages, known)
        self.worker = answer.worker


@dataclass
class Answer:
    text: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int | None
    engine_data: dict[str, Any]
    worker: int | None


async def _streamed_turn(http, url: str, body: dict[str, Any],
                         headers: dict[str, str]) -> Answer:
    """One streamed chat turn: its text, TTFT (the first event with a choice), usage, and the
    worker's turn data where the frontend was asked for it."""
    sent = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    worker = None
    async with http.post(url, json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:400]}")
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"error event: {json.dumps(chunk['error'])[:400]}")
            choices = chunk.get("choices") or []
            if choices and first is None:
                first = time.perf_counter()
            for choice in choices:
                pieces.append((choice.get("delta") or {}).get("content") or "")
            usage = chunk.get("usage") or usage
            nvext = chunk.get("nvext") or {}
            engine = nvext.get("engine_data") or engine
            worker = (nvext.get("worker_id") or {}).get("decode_worker_id", worker)
    ended = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream ended without a choice")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if cached is None:
        cached = engine.get("cached_prompt_tokens")
    completion = usage.get("completion_tokens")
    if completion is None:
        completion = len(engine.get("token_ids") or ())
    return Answer("".join(pieces), first - sent, ended - sent, usage.get("prompt_tokens"),
                  int(completion), cached, engine, worker)
