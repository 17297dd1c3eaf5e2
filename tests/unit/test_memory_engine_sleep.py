"""The memory engine passes the sleep port's contract suite, and frees what it says: level 1
its cache (the weights stay), level 2 its weights too, until a refit loads them. Through the
in-memory transport, a rollout refused asleep reaches the rollout client as the real worker
answers it: a 503 naming the worker, retried, then given up with that message."""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.adapters.memory import EngineCompletionsTransport, MemoryCollective, MemoryWeightSender
from rollout_fleet.adapters.memory.engine import MemoryEngine, TinyBigramModel, decode
from rollout_fleet.core.errors import EngineAsleep, HttpStatusError, RefitError, RetriesExhausted
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, RefitInfo
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.rollout import RolloutRequest, SamplingSpec
from rollout_fleet.core.rollout_client import RolloutClient
from rollout_fleet.core.sleep import WorkerSleep
from rollout_fleet.ports.contracts.engine import EngineUnderTest
from rollout_fleet.ports.contracts.sleeper import SleeperContract
from tests.support.memory_group import SwappableGroup

PROMPTS = [[3, 4, 5], [10, 11], [20, 21, 22, 23]]
SPEC = CollectiveSenderSpec(buffer_bytes=1024, num_buffers=2)


GROUP = SwappableGroup()


def refit_with(eut, state):
    """A refit of ``state`` through the in-memory collective (trainer rank 0)."""
    engine = eut.engine
    GROUP.collective = MemoryCollective()
    join = GroupJoin(host="127.0.0.1", port=1, world_size=2, train_world_size=1, first_rank=1,
                     ranks_per_worker=1, sender_spec=SPEC, timeout_s=5.0, backend="gloo")
    eut.loop.run(engine.init_collective(join))
    metas = engine.weight_metas()
    info = RefitInfo(tuple(metas[name] for name in state))
    pending = asyncio.run_coroutine_threadsafe(engine.update_weights(info), eut.loop.loop)
    MemoryWeightSender(GROUP.collective, SPEC).send(info, state.items())
    return pending.result(30)


@pytest.fixture(scope="class")
def engine_under_test():
    harness = EngineUnderTest.start(
        lambda: MemoryEngine(seed=0, context_length=128, token_delay_s=0.0,
                             join_receiver=GROUP.join_receiver),
        decode=decode, prompts=PROMPTS)
    yield harness
    harness.close()


@pytest.fixture
def reload_weights():
    return lambda eut: refit_with(eut, TinyBigramModel.from_seed(0).state_dict())


class TestMemoryEngineSleeps(SleeperContract):
    pass


def test_level_1_frees_the_cache_and_keeps_the_weights_level_2_forgets_them():
    engine = MemoryEngine(seed=0)

    async def steps():
        await engine.serve_rollout([3, 4], request_id="a", max_new_tokens=4, sampling=SamplingSpec())
        assert engine.model._logprob_rows  # the cache holds rows
        await engine.sleep(1)
        assert engine.model._logprob_rows == {} and engine.resident() == {"weights": True,
                                                                          "kv_cache": False}
        await engine.wake_up()
        await engine.sleep(2)
        assert engine.model.embed is None and engine.model.lm_head is None
        await engine.wake_up(["weights"])
        return engine.resident()

    assert asyncio.run(steps()) == {"weights": False, "kv_cache": False}


def test_a_refit_into_sleeping_weights_is_refused_until_they_are_woken():
    engine = MemoryEngine(seed=0)
    asyncio.run(engine.sleep(1))
    with pytest.raises(EngineAsleep):
        engine.sleeper.check_refit_allowed(["embed.weight", "lm_head.weight"])
    asyncio.run(engine.wake_up(["weights"]))
    engine.sleeper.check_refit_allowed(["embed.weight"])  # level 1: the weights are still there


def test_after_level_2_a_refit_must_carry_every_weight():
    engine = MemoryEngine(seed=0)
    asyncio.run(engine.sleep(2))
    asyncio.run(engine.wake_up(["weights"]))
    with pytest.raises(RefitError, match="every weight"):
        engine.sleeper.check_refit_allowed(["embed.weight"])


def test_keep_mode_holds_the_rollouts_in_flight_until_the_wake():
    engine = MemoryEngine(seed=0, token_delay_s=0.002)

    async def steps():
        prompt = [3, 4]
        want = await engine.serve_rollout(prompt, request_id="w", max_new_tokens=30,
                                          sampling=SamplingSpec())
        rollout = asyncio.ensure_future(engine.serve_rollout(
            prompt, request_id="k", max_new_tokens=30, sampling=SamplingSpec()))
        await asyncio.sleep(0.01)
        await engine.sleep(1, mode="keep")
        steps_asleep = engine.progress()
        await asyncio.sleep(0.05)
        assert engine.progress() == steps_asleep and not rollout.done()  # frozen
        await engine.wake_up()
        return want, await rollout

    want, kept = asyncio.run(steps())
    assert kept.token_ids == want.token_ids  # continued where it stood, same answer


def test_the_controls_answer_what_changed():
    engine = MemoryEngine(seed=0)
    controls = WorkerSleep(engine).controls()
    first = asyncio.run(controls["sleep"]({"level": 1}))
    again = asyncio.run(controls["sleep"]({"level": 1}))
    assert first["changed"] and first["sleeping"] and not again["changed"]
    assert asyncio.run(controls["is_sleeping"]({}))["level"] == 1
    woke = asyncio.run(controls["wake_up"]({"tags": None}))
    assert woke["changed"] and woke["serving"]
    assert not asyncio.run(controls["wake_up"]({}))["changed"]


def test_a_rollout_asleep_is_retried_then_given_up_with_the_workers_message():
    engine = MemoryEngine(seed=0)
    asyncio.run(engine.sleep(1))
    transport = EngineCompletionsTransport(engine, worker_id="worker-3")
    client = RolloutClient(transport, model="memory",
                           retry=RetryPolicy(max_attempts=3, base_delay_s=0.0, jitter=0.0))
    request = RolloutRequest(prompt_token_ids=(3, 4), max_new_tokens=4, request_id="r",
                             sampling=SamplingSpec())
    with pytest.raises(RetriesExhausted) as gave_up:
        asyncio.run(client.rollout(request))
    assert gave_up.value.attempts == 3 and isinstance(gave_up.value.last_error, HttpStatusError)
    assert gave_up.value.last_error.status == 503
    assert "worker worker-3 is asleep (level 1); the trainer wakes it with " \
           "prepare_for_generation / rollout-fleet wake" in str(gave_up.value)
    asyncio.run(engine.wake_up())
    assert asyncio.run(client.rollout(request)).token_ids
