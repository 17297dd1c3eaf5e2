"""The colocated refit protocol's pure logic (manifest, handles, the session's order) and the
worker's controls over the memory engine, with real shared-memory segments in this process."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_fleet.adapters.memory.engine import MemoryEngine, TinyBigramModel
from rollout_fleet.core.colocated_refit import (
    SEGMENT_PREFIX,
    BufferHandle,
    ColocatedManifest,
    ColocatedSession,
    bucket_entries_wire,
)
from rollout_fleet.core.colocated_service import WorkerColocatedRefit
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import RefitInfo, TensorMeta
from tests.support.shm_pack import ListPool, bucket_body, new_session_id

METAS = (TensorMeta("a", (4, 8), "float32"), TensorMeta("b", (16,), "float32"),
         TensorMeta("c", (3, 3), "float32"), TensorMeta("d", (100,), "float32"))
INFO = RefitInfo(METAS)


def manifest(buffer_bytes=128, num_buffers=2, transport="shm", info=INFO):
    return ColocatedManifest(info, buffer_bytes, num_buffers, transport)


def handle(slot=0, nbytes=1 << 12):
    return BufferHandle("shm", slot, nbytes, name=f"{SEGMENT_PREFIX}test-{slot}")


def test_the_manifest_round_trips_and_sizes_buffers_as_the_packed_plan():
    m = manifest()
    assert ColocatedManifest.from_wire(m.to_wire()) == m
    assert m.to_wire()["protocol"] == "rollout-fleet-colocated-v1"
    assert m.slot_bytes == max(b.nbytes for b in m.plan)
    assert m.bound_bytes == 2 * m.slot_bytes
    assert len(m.plan) > 1


@pytest.mark.parametrize("wire, field", [
    ({"refit_info": INFO.to_wire(), "buffer_bytes": 0, "num_buffers": 2, "transport": "shm"}, "buffer_bytes"),
    ({"refit_info": INFO.to_wire(), "buffer_bytes": 8, "num_buffers": 2, "transport": "tcp"}, "transport"),
    ({"refit_info": INFO.to_wire(), "buffer_bytes": 8, "num_buffers": 2}, "manifest"),
    ({"refit_info": INFO.to_wire(), "buffer_bytes": 8, "num_buffers": 2, "transport": "shm",
      "extra": 1}, "manifest"),
    ({"refit_info": INFO.to_wire(), "buffer_bytes": 8, "num_buffers": 2, "transport": "shm",
      "protocol": "rollout-fleet-packed-v1"}, "protocol"),
])
def test_a_bad_manifest_is_refused_naming_the_field(wire, field):
    with pytest.raises(InvalidValue, match=field):
        ColocatedManifest.from_wire(wire)


@pytest.mark.parametrize("wire, field", [
    ({"transport": "shm", "slot": 0, "nbytes": 8, "name": "psm_1234"}, "handle.name"),
    ({"transport": "shm", "slot": 0, "nbytes": 8, "name": SEGMENT_PREFIX + "../etc"}, "handle.name"),
    ({"transport": "shm", "slot": -1, "nbytes": 8, "name": SEGMENT_PREFIX + "x"}, "handle.slot"),
    ({"transport": "shm", "slot": 0, "nbytes": 0, "name": SEGMENT_PREFIX + "x"}, "handle.nbytes"),
    ({"transport": "cuda", "slot": 0, "nbytes": 8, "cuda": {"device_uuid": "x"}}, "handle.cuda"),
])
def test_a_bad_handle_is_refused_naming_the_field(wire, field):
    with pytest.raises(InvalidValue, match=field):
        BufferHandle.from_wire(wire)


def _session(**kw):
    return ColocatedSession.begin("s1", manifest(**kw), current_version=3)


def test_buckets_in_order_then_finish():
    session = _session()
    for index, bucket in enumerate(session.plan):
        assert session.take_bucket(index, bucket_entries_wire(bucket), handle(index % 2)) == bucket
    assert session.check_finish() is None
    assert session.state == "finished"


@pytest.mark.parametrize("step, message", [
    (lambda s: s.take_bucket(1, bucket_entries_wire(s.plan[1]), handle()), "out of order"),
    (lambda s: s.take_bucket("0", bucket_entries_wire(s.plan[0]), handle()), "out of order"),
    (lambda s: s.take_bucket(0, [["b", 0]], handle()), "the plan puts 'a' at offset 0"),
    (lambda s: s.take_bucket(0, bucket_entries_wire(s.plan[0]) + [["x", 9]], handle()), "holds"),
    (lambda s: s.take_bucket(0, bucket_entries_wire(s.plan[0]), handle(slot=2)), "2 buffers"),
    (lambda s: s.take_bucket(0, bucket_entries_wire(s.plan[0]), handle(nbytes=4)), "needs"),
    (lambda s: s.take_bucket(0, bucket_entries_wire(s.plan[0]),
                             BufferHandle("cuda", 0, 1 << 12, cuda=_cuda())), "transport"),
    (lambda s: s.check_finish(), "finish after 0 of"),
])
def test_a_wrong_step_fails_the_session_and_every_later_step_names_it(step, message):
    session = _session()
    with pytest.raises((RefitError, InvalidValue), match=message):
        step(session)
    assert session.state == "failed"
    with pytest.raises(RefitError, match="failed earlier"):
        session.take_bucket(0, bucket_entries_wire(session.plan[0]), handle())
    with pytest.raises(RefitError, match="failed earlier"):
        session.check_finish()


def test_a_finished_session_takes_nothing_more():
    session = ColocatedSession.begin("s", manifest(buffer_bytes=1 << 20), 0)
    session.take_bucket(0, bucket_entries_wire(session.plan[0]), handle())
    session.check_finish()
    with pytest.raises(RefitError, match="is finished"):
        session.take_bucket(1, [], handle())


@pytest.mark.parametrize("wanted", [3, 2, 0, -1, True, "4"])
def test_a_version_that_does_not_go_up_is_refused_at_begin(wanted):
    with pytest.raises(InvalidValue, match="weight_version"):
        ColocatedSession.begin("s", manifest(), current_version=3, wanted_version=wanted)


@given(st.lists(st.integers(0, 300), min_size=1, max_size=12), st.integers(1, 2048),
       st.integers(1, 3))
def test_any_plan_is_walked_in_order_and_fits_the_buffers(sizes, buffer_bytes, buffers):
    info = RefitInfo(tuple(TensorMeta(f"t{i}", (n,), "float32") for i, n in enumerate(sizes)))
    m = manifest(buffer_bytes, buffers, info=info)
    session = ColocatedSession.begin("s", m, 0, 1)
    names = []
    for index, bucket in enumerate(session.plan):
        assert bucket.nbytes <= m.slot_bytes
        session.take_bucket(index, bucket_entries_wire(bucket), handle(index % buffers, m.slot_bytes))
        names += [e.meta.name for e in bucket.entries]
    assert names == [t.name for t in info.tensors]
    assert session.check_finish() == 1


def _cuda():
    return {k: 0 for k in ("device_uuid", "storage_handle", "storage_size_bytes",
                           "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset",
                           "event_handle", "event_sync_required")}


# -- the worker's controls over the memory engine, with real segments ------------------------

def _memory_manifest(buffer_bytes=800, num_buffers=2):
    engine_metas = MemoryEngine().weight_metas()
    return ColocatedManifest(RefitInfo(tuple(engine_metas.values())), buffer_bytes, num_buffers, "shm")


def _refit(service, pool, state, *, version=None, session=None):
    async def run():
        sid = session or new_session_id()
        body = {"session": sid, "manifest": pool.manifest.to_wire()}
        if version is not None:
            body["weight_version"] = version
        await service.start(body)
        for index, bucket in enumerate(pool.manifest.plan):
            slot = index % pool.manifest.num_buffers
            await service.bucket(bucket_body(sid, index, bucket, pool.pack(bucket, state, slot)))
        return await service.finish({"session": sid})
    return asyncio.run(run())


@pytest.fixture
def pool():
    pool = ListPool(_memory_manifest())
    yield pool
    pool.close()


def test_a_colocated_refit_loads_exactly_resets_the_cache_and_bumps_the_version(pool):
    engine = MemoryEngine(seed=0)
    service = WorkerColocatedRefit(engine)
    other = TinyBigramModel.from_seed(1).state_dict()
    resets = engine.cache_resets
    answer = _refit(service, pool, other)
    assert answer["weight_version"] == 1 and answer["buckets"] == len(pool.manifest.plan) > 1
    assert engine.model.state_dict() == _float32(other)
    assert engine.cache_resets == resets + 1
    assert _refit(service, pool, TinyBigramModel.from_seed(0).state_dict(), version=7)["weight_version"] == 7


def test_a_wrong_shape_is_refused_naming_the_tensor_before_anything_loads(pool):
    engine = MemoryEngine(seed=0)
    service = WorkerColocatedRefit(engine)
    metas = list(engine.weight_metas().values())
    bad = RefitInfo((metas[0], TensorMeta(metas[1].name, (5, 5), "float32")))
    body = {"session": "s", "manifest": ColocatedManifest(bad, 800, 2, "shm").to_wire()}
    with pytest.raises(InvalidValue, match="shape of 'lm_head.weight'"):
        asyncio.run(service.start(body))
    assert service.session is None and engine.weight_version() == 0


def test_a_handle_that_cannot_be_opened_fails_the_session_and_keeps_the_weights(pool):
    engine = MemoryEngine(seed=0)
    service = WorkerColocatedRefit(engine)
    before = engine.model.state_dict()

    async def run():
        await service.start({"session": "s", "manifest": pool.manifest.to_wire()})
        bucket = pool.manifest.plan[0]
        gone = BufferHandle("shm", 0, pool.manifest.slot_bytes, name=SEGMENT_PREFIX + "gone")
        with pytest.raises(RefitError, match="cannot open shared-memory segment"):
            await service.bucket(bucket_body("s", 0, bucket, gone))
        with pytest.raises(RefitError, match="failed earlier"):
            await service.bucket(bucket_body("s", 0, bucket, pool.pack(bucket, before, 0)))
        with pytest.raises(RefitError, match="failed earlier"):
            await service.finish({"session": "s"})
    asyncio.run(run())
    assert engine.model.state_dict() == before and engine.weight_version() == 0
    assert _refit(service, pool, TinyBigramModel.from_seed(1).state_dict())["weight_version"] == 1


def test_a_second_start_while_one_is_open_is_refused_and_abort_frees_it(pool):
    engine = MemoryEngine(seed=0)
    service = WorkerColocatedRefit(engine)

    async def run():
        await service.start({"session": "a", "manifest": pool.manifest.to_wire()})
        with pytest.raises(RefitError, match="session 'a'"):
            await service.start({"session": "b", "manifest": pool.manifest.to_wire()})
        with pytest.raises(RefitError, match="not the colocated refit open"):
            await service.bucket({"session": "b", "index": 0})
        assert (await service.abort({"session": "a"}))["aborted"] == "a"
    asyncio.run(run())
    assert engine.weight_version() == 0
    assert _refit(service, pool, TinyBigramModel.from_seed(1).state_dict())["weight_version"] == 1


def test_buffers_are_released_only_between_refits_and_keep_buffers_is_checked(pool):
    engine = MemoryEngine(seed=0)
    service = WorkerColocatedRefit(engine)

    async def run():
        with pytest.raises(InvalidValue, match="keep_buffers"):
            await service.start({"session": "k", "manifest": pool.manifest.to_wire(),
                                 "keep_buffers": "yes"})
        await service.start({"session": "a", "manifest": pool.manifest.to_wire(),
                             "keep_buffers": True})
        with pytest.raises(RefitError, match="session 'a'.*before its buffers are released"):
            await service.release({})
        await service.abort({"session": "a"})
        assert await service.release({}) == {"released": True}
    asyncio.run(run())
    assert _refit(service, pool, TinyBigramModel.from_seed(1).state_dict())["weight_version"] == 1


def test_a_session_whose_trainer_went_quiet_is_given_up(pool):
    engine = MemoryEngine(seed=0)
    service = WorkerColocatedRefit(engine, idle_timeout_s=0.05)
    state = TinyBigramModel.from_seed(1).state_dict()

    async def run():
        await service.start({"session": "q", "manifest": pool.manifest.to_wire()})
        bucket = pool.manifest.plan[0]
        await service.bucket(bucket_body("q", 0, bucket, pool.pack(bucket, state, 0)))
        await asyncio.sleep(0.3)
        with pytest.raises(RefitError, match="the trainer is gone"):
            await service.finish({"session": "q"})
    asyncio.run(run())
    assert engine.weight_version() == 0 and engine.model.state_dict() == TinyBigramModel.from_seed(0).state_dict()


def test_an_engine_with_more_ranks_refuses_colocated_refits(pool):
    service = WorkerColocatedRefit(MemoryEngine(refit_ranks=2))
    with pytest.raises(InvalidValue, match="tensor parallel 1 only"):
        asyncio.run(service.start({"session": "s", "manifest": pool.manifest.to_wire()}))
    assert service.session is None


def _float32(state):
    import array

    return {name: [array.array("f", row).tolist() for row in rows] for name, rows in state.items()}


# -- several buckets in one call (a sender whose buffers are not reused within a refit) --------

@pytest.fixture
def one_buffer_a_bucket():
    plan_of = _memory_manifest()
    pool = ListPool(ColocatedManifest(plan_of.info, 800, len(plan_of.plan), "shm"))
    yield pool
    pool.close()


def _all_buckets(pool, state, session="s"):
    return {"session": session, "buckets": [bucket_body(session, index, bucket, pool.pack(bucket, state, index))
                                            for index, bucket in enumerate(pool.manifest.plan)]}


def test_every_bucket_in_one_call_loads_as_one_call_a_bucket_does(one_buffer_a_bucket):
    pool, engine = one_buffer_a_bucket, MemoryEngine(seed=0)
    service = WorkerColocatedRefit(engine)
    other = TinyBigramModel.from_seed(1).state_dict()

    async def run():
        await service.start({"session": "s", "manifest": pool.manifest.to_wire()})
        answer = await service.buckets(_all_buckets(pool, other))
        assert answer["indices"] == list(range(len(pool.manifest.plan))) and len(answer["indices"]) > 1
        return await service.finish({"session": "s"})
    assert asyncio.run(run())["weight_version"] == 1
    assert engine.model.state_dict() == _float32(other)


def test_a_bucket_out_of_order_among_several_fails_the_session_and_keeps_the_weights(
        one_buffer_a_bucket):
    pool, engine = one_buffer_a_bucket, MemoryEngine(seed=0)
    service = WorkerColocatedRefit(engine)
    before = engine.model.state_dict()

    async def run():
        await service.start({"session": "s", "manifest": pool.manifest.to_wire()})
        with pytest.raises(InvalidValue, match="buckets"):
            await service.buckets({"session": "s", "buckets": {}})
        body = _all_buckets(pool, TinyBigramModel.from_seed(1).state_dict())
        body["buckets"][1]["index"] = 5
        with pytest.raises((RefitError, InvalidValue)):
            await service.buckets(body)
        with pytest.raises(RefitError, match="bucket 5"):
            await service.finish({"session": "s"})
    asyncio.run(run())
    assert engine.model.state_dict() == before and engine.weight_version() == 0
