"""vLLM's pause around a refit: new requests held, those in flight drained or frozen as the
refit mode says, and generation always resumed after."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from rollout_fleet.core.refit import DEFAULT_REFIT_MODE, RefitMode

# vLLM's pause modes: "wait" lets the requests in flight finish first; "keep" freezes them in
# the scheduler, where they stay (KV included) until generation resumes.
_VLLM_PAUSE = {RefitMode.DRAIN: "wait", RefitMode.KEEP: "keep", RefitMode.RECOMPUTE: "keep"}


@contextlib.asynccontextmanager
async def paused_for_refit(engine: Any, mode: RefitMode = DEFAULT_REFIT_MODE
                           ) -> AsyncIterator[None]:
    """Hold new requests, drain or freeze those in flight (``mode``), and always resume (even
    on a failed load)."""
    await _pause(engine, _VLLM_PAUSE[mode])
    try:
        yield
    finally:
        await engine.resume_generation()


async def _pause(engine: Any, vllm_mode: str) -> None:
    """vLLM's ``pause_generation``, less its fixed 20 ms sleep when nothing is in flight: that
    sleep only lets in-flight requests' last outputs through first, and an idle engine has none
    (it was most of a small model's refit). Busy, or without those parts: vLLM's own call."""
    has_unfinished = getattr(getattr(engine, "output_processor", None),
                             "has_unfinished_requests", None)
    pause_scheduler = getattr(getattr(engine, "engine_core", None), "pause_scheduler_async", None)
    if callable(has_unfinished) and callable(pause_scheduler) and not has_unfinished():
        await pause_scheduler(mode=vllm_mode, clear_cache=False)
    else:
        await engine.pause_generation(mode=vllm_mode, clear_cache=False)
