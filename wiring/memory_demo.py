"""The in-memory demo: rollouts through the core's client, one refit, rollouts again.

Runs anywhere the core runs (no Dynamo, no vLLM): the same services the fleet uses, wired to
the in-memory engine, transport, control channel and collective, composed by
``wiring/driver.py``'s ``build_memory_driver``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollout_fleet.adapters.memory import MemoryCollective, MemoryEngine, MemoryWeightSender, TinyBigramModel
from rollout_fleet.adapters.memory.engine import VOCAB, decode
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo
from rollout_fleet.core.rollout import SamplingSpec
from rollout_fleet.core.rollout_client import RolloutLimits
from rollout_fleet.wiring.driver import build_memory_driver

TARGET = frozenset(i for i, piece in enumerate(VOCAB) if piece and piece[0] in "aeiou")


def reward(token_ids) -> float:
    """The fraction of generated tokens that start with a vowel."""
    return sum(t in TARGET for t in token_ids) / max(1, len(token_ids))


async def run_memory_demo(num_workers: int = 2, prompts: int = 8, group: int = 4) -> dict:
    group_ = MemoryCollective()  # the refit group's in-memory stand-in
    engines = [MemoryEngine(seed=0, join_receiver=group_.join_receiver) for _ in range(num_workers)]
    driver = build_memory_driver(engines, model="memory", refit_timeout_s=30)
    clients = driver.clients
    limits = RolloutLimits(max_model_len=128, max_new_tokens=24)
    prompt_ids = [[1 + (i * 5) % 40, 2 + (i * 3) % 40] for i in range(prompts)]

    async def batch(tag: str):
        started = time.perf_counter()
        jobs = []
        for p, prompt in enumerate(prompt_ids):
            for g in range(group):
                request = limits.request(f"{tag}-{p}-{g}", prompt,
                                         sampling=SamplingSpec(greedy=False, seed=p * 100 + g))
                jobs.append(clients[(p * group + g) % num_workers].rollout(request))
        results = await asyncio.gather(*jobs)
        seconds = time.perf_counter() - started
        return results, seconds

    coordinator = driver.refits
    spec = CollectiveSenderSpec(buffer_bytes=1 << 20, num_buffers=2)
    figures: dict[str, Any] = {}
    results, seconds = await batch("before")
    figures["before"] = _summary(results, seconds)
    print(f"rollouts before refit: {figures['before']}")
    print(f"  e.g. {decode(results[0].token_ids)!r}")

    new_weights = TinyBigramModel.from_seed(1).state_dict()
    info = RefitInfo.from_state_dict_info({n: ((len(VOCAB), 8), "float32") for n in new_weights})
    started = time.perf_counter()
    await asyncio.gather(*coordinator.init_collective_calls("127.0.0.1", 1, 1 + num_workers, 1, spec))
    await coordinator.prepare_refit_info(info)
    updating = asyncio.ensure_future(coordinator.update_weights())
    await asyncio.to_thread(MemoryWeightSender(group_, spec).send, info, new_weights.items())
    versions = await updating
    await coordinator.invalidate_caches()
    figures["refit_seconds"] = round(time.perf_counter() - started, 4)
    figures["weight_versions"] = versions
    print(f"refit: {figures['refit_seconds']} s, weight versions {versions}")

    results, seconds = await batch("after")
    figures["after"] = _summary(results, seconds)
    print(f"rollouts after refit:  {figures['after']}")
    print(f"  e.g. {decode(results[0].token_ids)!r}")
    return figures


def _summary(results, seconds: float) -> dict:
    tokens = sum(len(r.token_ids) for r in results)
    return {"rollouts": len(results), "tokens": tokens,
            "mean_reward": round(sum(reward(r.token_ids) for r in results) / len(results), 4),
            "rollouts_per_s": round(len(results) / seconds, 1),
            "weight_versions": sorted({r.weight_version for r in results})}
