"""The harness every engine suite drives: a started engine on a private loop
(``EngineUnderTest``), what the suites ask of it, and the greedy sampling they ask with."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import attrs
from rollout_fleet.core.loop_thread import LoopThread
from rollout_fleet.core.rollout import SamplingSpec, ServedRollout
from rollout_fleet.ports.engine import EngineFacts, EnginePort

GREEDY = SamplingSpec()


@attrs.define
class EngineUnderTest:
    """A started engine, its private loop, and what the suite needs to know about its vocabulary."""

    engine: EnginePort
    loop: LoopThread
    facts: EngineFacts
    decode: Callable[[Sequence[int]], str]  # generated token IDs -> text, as stop strings see it
    prompts: Sequence[Sequence[int]]  # a few ordinary prompts (>= 2)
    close_engine: Callable[[EnginePort], Any] | None = None
    _counter: int = 0

    @classmethod
    def start(cls, make_engine: Callable[[], EnginePort], *,
              decode: Callable[[Sequence[int]], str], prompts: Sequence[Sequence[int]],
              close_engine: Callable[[EnginePort], Any] | None = None,
              worker_id: int | str = 0) -> "EngineUnderTest":
        loop = LoopThread()
        engine = loop.run(_make_async(make_engine))
        facts = loop.run(engine.start(worker_id))
        return cls(engine, loop, facts, decode, prompts, close_engine)

    def close(self) -> None:
        if self.close_engine is not None:
            result = self.close_engine(self.engine)
            if asyncio.iscoroutine(result):
                self.loop.run(result)
        self.loop.close()

    def next_id(self) -> str:
        self._counter += 1
        return f"contract-{self._counter}"

    def serve(self, prompt: Sequence[int], max_new_tokens: int = 16,
              sampling: SamplingSpec = GREEDY, stop_strings: Sequence[str] = (),
              request_id: str | None = None) -> ServedRollout:
        return self.loop.run(self.engine.serve_rollout(
            list(prompt), request_id=request_id or self.next_id(), max_new_tokens=max_new_tokens,
            sampling=sampling, stop_strings=stop_strings))

    def serve_offered(self, prompt: Sequence[int], max_new_tokens: int,
                      sampling: SamplingSpec = GREEDY, **keywords: Any) -> ServedRollout:
        """``serve`` with optional keywords (``extra_sampling``, ``top_logprobs``...): as the
        port says (``core.engine.EnginePort.serve_rollout``), an engine takes those its own
        signature declares, and is passed no other."""
        declared = inspect.signature(self.engine.serve_rollout).parameters
        undeclared = sorted(set(keywords) - set(declared))
        assert not undeclared, f"the engine's serve_rollout does not declare {undeclared}"
        serve: Callable[..., Coroutine[Any, Any, ServedRollout]] = self.engine.serve_rollout
        return self.loop.run(serve(list(prompt), request_id=self.next_id(),
                                   max_new_tokens=max_new_tokens, sampling=sampling, **keywords))

    def greedy_answers(self, max_new_tokens: int) -> list[tuple[int, ...]]:
        """Every prompt's greedy tokens: what a refit or a sleep must change or keep."""
        return [self.serve(prompt, max_new_tokens).token_ids for prompt in self.prompts]


async def _make_async(make_engine: Callable[[], EnginePort]) -> EnginePort:
    return make_engine()
