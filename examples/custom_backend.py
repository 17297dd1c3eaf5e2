"""A new backend in one file: the engine port's four methods, over a toy "engine".

CountingEngine continues a prompt by counting upward modulo its vocabulary, with a fixed
logprob per token; it stops at a stop string or the budget, and honours abort. Its contract
test (tests/examples/test_examples.py) runs the project's EngineContract suite against it,
exactly as a real backend's own tests would.

CountingKind makes it servable by a fleet: installed as a package that names it in the
entry-point group ``rollout_fleet.engines`` (docs/adding-a-backend.md), a fleet config selects
it with ``engine = { kind = "counting" }``, with no change to rollout-fleet
(tests/examples/test_third_party_backend.py does exactly that).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollout_fleet.core.errors import EngineError, InvalidValue
from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout, Usage
from rollout_fleet.ports.engine import EngineFacts, EnginePort, KvEventSource
from rollout_fleet.ports.engine_kind import BuiltEngine, EngineKind, FleetFacts

VOCAB = 26  # token t is the letter chr(ord("a") + t)


def decode(token_ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + t) for t in token_ids)


class CountingEngine(EnginePort):
    def __init__(self, context_length: int = 64) -> None:
        self.context_length = context_length
        self._aborted: set[str] = set()

    async def start(self, worker_id: int | str) -> EngineFacts:
        return EngineFacts(context_length=self.context_length, kv_block_size=16,
                           total_kv_blocks=64, max_num_seqs=32)

    async def serve_rollout(self, prompt_token_ids: Sequence[int], *, request_id: str,
                            max_new_tokens: int, sampling: SamplingSpec,
                            stop_strings: Sequence[str] = ()) -> ServedRollout:
        if len(prompt_token_ids) + max_new_tokens > self.context_length:
            raise EngineError(f"prompt of {len(prompt_token_ids)} + {max_new_tokens} tokens "
                              f"exceeds context_length={self.context_length}")
        rng = random.Random(sampling.seed)
        step = 1 if sampling.greedy else rng.randint(1, 5)  # sampling picks the stride
        tokens: list[int] = []
        finish = FinishReason.LENGTH
        token = prompt_token_ids[-1]
        for _ in range(max_new_tokens):
            await asyncio.sleep(0)  # let aborts in
            if request_id in self._aborted:
                finish = FinishReason.ABORT
                break
            token = (token + step) % VOCAB
            tokens.append(token)
            if any(stop in decode(tokens) for stop in stop_strings):
                finish = FinishReason.STOP
                break
        self._aborted.discard(request_id)
        logprob = -math.log(VOCAB if not sampling.greedy else 2)
        return ServedRollout(tokens, [logprob] * len(tokens), finish,
                             Usage(len(prompt_token_ids), len(tokens)))

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def kv_event_sources(self) -> Sequence[KvEventSource]:
        return ()


@attrs.frozen
class CountingSettings:
    """The counting engine's one option, checked once where the config is read."""

    context_length: int = attrs.field(default=64)

    @context_length.validator
    def _at_least_two(self, _attr: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise InvalidValue("context_length", value, "must be an int >= 2")


class CountingKind(EngineKind[CountingSettings]):
    """How a fleet makes a CountingEngine, from its typed settings."""

    def parse(self, options: Mapping[str, Any], fleet: FleetFacts | None) -> CountingSettings:
        for key, value in options.items():
            if key != "context_length":
                raise InvalidValue(key, value, "not an option of the counting engine")
        return CountingSettings(**options)

    def build(self, settings: CountingSettings, *, run_dir: Path,
              model_path: str | None) -> BuiltEngine:
        # model_path: the fleet's model folder (its tokenizer serves the text side)
        return BuiltEngine(CountingEngine(settings.context_length), model_path)


if __name__ == "__main__":
    async def main() -> None:
        engine = CountingEngine()
        print(await engine.start(0))
        served = await engine.serve_rollout([0, 1, 2], request_id="r1", max_new_tokens=8,
                                            sampling=SamplingSpec(), stop_strings=["gh"])
        print(decode(served.token_ids), served.finish_reason.value)

    asyncio.run(main())
