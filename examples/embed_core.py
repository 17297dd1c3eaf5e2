"""Embedding rollout-fleet's core in your own trainer.

The core needs only attrs. Your trainer builds requests with the core's rules, sends them with
the core's rollout client through any CompletionsTransport, and refits workers with the core's
coordinator through any WorkerControl. Here every port is the in-memory adapter, so this runs
anywhere; against a real fleet, swap in the http adapter's transport and controls (or use
``Fleet.generation()``, which does that wiring for you).

Run: python examples/embed_core.py   (CI runs it and checks its exit code)
"""

from __future__ import annotations

import asyncio
import statistics

from rollout_fleet.adapters.memory import (
    EngineCompletionsTransport, LocalWorkerControl, MemoryCollective, MemoryEngine,
    MemoryWeightSender, TinyBigramModel,
)
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo
from rollout_fleet.core.refit_service import RefitCoordinator, WorkerRefit
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.rollout import SamplingSpec
from rollout_fleet.core.rollout_client import RolloutClient, RolloutLimits
from rollout_fleet.ports.completions import TransportResponse

GROUP = 4


async def main() -> int:
    # 1. The fleet's rules, in one value: context window, budget, stop strings.
    limits = RolloutLimits(max_model_len=64, max_new_tokens=12, stop_strings=(".",))

    # 2. A worker (here in memory) and a transport whose first answer is a 503, as a loaded
    #    router would give: the client retries it with backoff, under the same request id.
    collective = MemoryCollective()  # the refit group, in memory (torch.distributed in a fleet)
    engine = MemoryEngine(seed=0, join_receiver=collective.join_receiver)
    transport = EngineCompletionsTransport(engine, faults=[TransportResponse(503, b"busy")])
    client = RolloutClient(transport, model="memory", retry=RetryPolicy(max_attempts=3))

    # 3. Your trainer's batch: each prompt GROUP times, sampled with distinct seeds.
    prompts = [[3, 4], [10, 11, 12], [20]]
    requests = [limits.request(f"p{p}-g{g}", prompt, sampling=SamplingSpec(greedy=False, seed=g))
                for p, prompt in enumerate(prompts) for g in range(GROUP)]
    results = await asyncio.gather(*(client.rollout(r) for r in requests))
    lengths = [len(r.token_ids) for r in results]
    print(f"{len(results)} rollouts, lengths {lengths}, attempts {[r.attempts for r in results]}")
    assert sum(r.attempts for r in results) == len(results) + 1, "the 503 was retried once"

    # 4. Group-relative advantages, as GRPO computes them, from the rollouts' lengths as a reward.
    for p in range(len(prompts)):
        group = lengths[p * GROUP:(p + 1) * GROUP]
        mean = statistics.fmean(group)
        print(f"prompt {p}: advantages {[round(x - mean, 2) for x in group]}")

    # 5. A refit: the coordinator checks the world size and refit info on every worker before
    #    any byte moves, then every worker receives, loads and flushes its cache.
    worker = WorkerRefit(engine)
    coordinator = RefitCoordinator([LocalWorkerControl("worker-0", worker.controls())], timeout_s=10)
    spec = CollectiveSenderSpec(buffer_bytes=1 << 20)
    new_weights = TinyBigramModel.from_seed(1).state_dict()
    info = RefitInfo.from_state_dict_info({name: ((48, 8), "float32") for name in new_weights})
    await asyncio.gather(*coordinator.init_collective_calls("127.0.0.1", 1, 2, 1, spec))
    await coordinator.prepare_refit_info(info)
    updating = asyncio.ensure_future(coordinator.update_weights())
    await asyncio.to_thread(MemoryWeightSender(collective, spec).send, info, new_weights.items())
    print(f"weight versions after refit: {await updating}")
    await coordinator.invalidate_caches()

    after = await client.rollout(limits.request("after", [3, 4], sampling=SamplingSpec()))
    assert after.weight_version == 1, after
    print(f"greedy rollout served by weight version {after.weight_version}: {after.token_ids}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
