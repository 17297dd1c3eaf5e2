"""The vLLM engine's sleep and wake (``ports.engine.Sleeper``): ``VllmSleep``, a part of
``VllmEngine``.

On a GPU, vLLM sleeps when its engine was started with ``enable_sleep_mode`` (a colocated
fleet sets it, or the engine option ``enable_sleep_mode = true``): ``AsyncLLM.sleep(level,
mode)`` pauses the scheduler as ``mode`` says (wait, abort, keep), clears the prefix cache,
and frees the KV cache (level 1 copies the weights to host memory; level 2 drops them);
``AsyncLLM.wake_up(tags)`` takes back ``weights`` and/or ``kv_cache`` and resumes the
scheduler once everything is back. After a level-2 sleep the weights' memory comes back
without their values: the engine refuses rollouts until a refit succeeds.

On the CPU, vLLM has no sleep mode (``Platform.is_sleep_mode_available()`` is False there):
sleep is refused, naming the platform, and the engine keeps serving. Nothing is faked.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from rollout_fleet.core.errors import EngineRejected
from rollout_fleet.adapters.vllm.host.runtime import VllmRuntime
from rollout_fleet.core.sleep_state import DEFAULT_SLEEP_MODE, WAKE_TAGS, SleepState
from rollout_fleet.ports.engine import Sleeper


def sleep_refusal(engine: Any, platform: Any = None) -> str | None:
    """Why this started ``AsyncLLM`` cannot sleep (``platform``: vLLM's current platform unless
    given); None when it can."""
    if platform is None:
        from vllm.platforms import current_platform

        platform = current_platform
    name = getattr(platform, "device_name", None) or type(platform).__name__
    if not platform.is_sleep_mode_available():
        return (f"vLLM has no sleep mode on the {name} platform (Platform.is_sleep_mode_available()"
                " is False there): this worker cannot give its memory back; it keeps serving")
    if not all(callable(getattr(engine, m, None)) for m in ("sleep", "wake_up", "is_sleeping")):
        return "this vLLM's AsyncLLM has no sleep / wake_up / is_sleeping"
    if not getattr(engine.vllm_config.model_config, "enable_sleep_mode", False):
        return ("this vLLM engine was started without sleep mode: a colocated fleet sets it at"
                " engine start on GPUs (colocation.enabled, or the engine option"
                " enable_sleep_mode = true)")
    return None


def sleep_takes_mode(engine: Any) -> bool:
    """Whether ``AsyncLLM.sleep`` takes a pause ``mode`` (else the adapter pauses first)."""
    try:
        return "mode" in inspect.signature(engine.sleep).parameters
    except (TypeError, ValueError):
        return False


class VllmSleep(Sleeper):
    """Sleep and wake of the engine of ``runtime``, under its weight lock (no refit runs while
    the engine falls asleep or wakes); the sleep state lives in the runtime, where serving and
    refit read it."""

    def __init__(self, runtime: VllmRuntime, platform: Any = None) -> None:
        self.runtime = runtime
        self.platform = platform  # vLLM's current platform unless a test gives one

    async def sleep(self, level: int = 1, *, mode: str = DEFAULT_SLEEP_MODE) -> SleepState:
        wanted = self.runtime.sleep.wants_sleep(level, mode)
        if wanted is None:
            return self.runtime.sleep.state
        level, mode = wanted
        engine = self.runtime.require_engine()
        refusal = sleep_refusal(engine, self.platform)
        if refusal is not None:
            raise EngineRejected(f"sleep(level={level}) refused: {refusal}")
        async with self.runtime.weight_lock:
            if sleep_takes_mode(engine):
                await engine.sleep(level=level, mode=mode)
            else:  # an older vLLM: pause as asked first, then sleep
                await engine.pause_generation(mode=mode, clear_cache=True)
                await engine.sleep(level=level)
            self.runtime.standing.salt.clear()  # the prefix cache is gone with the KV cache
            return self.runtime.sleep.fell_asleep(level)

    async def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> SleepState:
        waking = self.runtime.sleep.wants_wake(tags)
        if not waking:
            return self.runtime.sleep.state
        engine = self.runtime.require_engine()
        async with self.runtime.weight_lock:
            await engine.wake_up(tags=list(waking))
            state = self.runtime.sleep.woke(waking)
            if not state.sleeping and not sleep_takes_mode(engine):
                await engine.resume_generation()  # newer vLLMs resume once fully awake
        return state

    def sleep_state(self) -> SleepState:
        return self.runtime.sleep.state
