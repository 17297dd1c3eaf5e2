"""The vLLM adapter's own behaviour beyond the shared contract: aborts reach vLLM, bad input is
refused by name and the engine keeps serving, settings come from config with device defaults."""

import asyncio
import os

import pytest

from rollout_fleet.adapters.vllm.host import VllmEngineConfig, engine_from_config
from rollout_fleet.core.errors import EngineError, InvalidValue
from rollout_fleet.core.refit import RefitInfo
from rollout_fleet.core.rollout import FinishReason, SamplingSpec
from tests.support.engine_core import engine_core_of, model_workers_of


def test_an_abort_ends_the_request_inside_vllm(vllm_engine):
    engine = vllm_engine.engine
    prompt = list(vllm_engine.prompts[0])
    budget = vllm_engine.facts.context_length - len(prompt)

    async def serve_then_abort():
        task = asyncio.create_task(engine.serve_rollout(
            prompt, request_id="abort-inside", max_new_tokens=budget,
            sampling=SamplingSpec(greedy=False, seed=3)))
        while "abort-inside" not in engine._live or not engine._live["abort-inside"].admitted:
            await asyncio.sleep(0.01)  # until vLLM has the request
        await engine.abort("abort-inside")
        served = await asyncio.wait_for(task, 120)
        return served, engine.runtime.engine.get_num_unfinished_requests()

    served, unfinished = vllm_engine.loop.run(serve_then_abort())
    assert served.finish_reason is FinishReason.ABORT
    assert len(served.token_ids) < budget
    assert unfinished == 0, "vLLM still holds the aborted request"


def test_a_crowd_of_seeded_rollouts_with_long_prompts_is_served(vllm_engine):
    """64 seeded rollouts of 200-token prompts at once: more prompt tokens than one step takes.
    vLLM's CPU worker dies on a seeded request whose prefill is split (it cannot rewind a CPU
    generator): the engine prefills whole prompts on the CPU, and every rollout is served."""
    engine = vllm_engine.engine
    vocab = 400

    async def crowd():
        return await asyncio.gather(*(engine.serve_rollout(
            [5 + (index * 7 + position) % vocab for position in range(200)],
            request_id=f"seeded-crowd-{index}", max_new_tokens=8,
            sampling=SamplingSpec(greedy=False, temperature=1.0, seed=index))
            for index in range(64)))

    served = vllm_engine.loop.run(crowd())
    assert len(served) == 64
    for rollout in served:  # its whole budget, or ended by the end-of-sequence token
        assert (rollout.finish_reason, len(rollout.token_ids)) == (FinishReason.LENGTH, 8) or \
            (rollout.finish_reason, rollout.token_ids[-1]) == (FinishReason.STOP, 2), rollout
    assert engine.dead_reason() is None


def test_a_stream_without_logprobs_asks_vllm_for_none(vllm_engine):
    """vLLM computes and hands out no logprobs then (each piece's are empty), as its own server
    does for a request that asks for none; the tokens are the greedy answer's."""
    prompt = list(vllm_engine.prompts[1])

    async def stream():
        return [piece async for piece in vllm_engine.engine.stream_rollout(
            prompt, request_id="bare-stream", max_new_tokens=10, sampling=SamplingSpec(),
            with_logprobs=False)]

    pieces = vllm_engine.loop.run(stream())
    assert all(piece.logprobs == () for piece in pieces)
    assert tuple(t for p in pieces for t in p.token_ids) == vllm_engine.serve(prompt, 10).token_ids


@pytest.mark.parametrize("prompt, budget, words", [
    ([5, 10**6], 4, r"prompt_token_ids\[1\]=1000000 is outside the model.s vocabulary of \d+ tokens"),
    ([5, 6], 0, "max_new_tokens"),
    ([5, 6], 511, "exceeds context_length=512"),
])
def test_bad_input_is_refused_by_name_and_serving_goes_on(vllm_engine, prompt, budget, words):
    with pytest.raises(EngineError, match=words):
        vllm_engine.serve(prompt, budget)
    assert len(vllm_engine.serve(vllm_engine.prompts[0], 3).token_ids) == 3


def test_kv_event_sources_are_empty_when_kv_events_are_off(vllm_engine):
    assert vllm_engine.engine.kv_event_sources() == ()


def test_on_the_cpu_vllms_processes_run_niced_and_this_one_does_not(vllm_engine):
    import psutil

    core = engine_core_of(os.getpid())  # found by title, else by place (a title can be missing)
    vllm = [core, *model_workers_of(os.getpid())]
    others = [p for p in psutil.Process().children(recursive=True) if p not in vllm]
    assert all(_nices(p) == {10} for p in vllm), {p.pid: _nices(p) for p in vllm}
    assert all(_nices(p) == {0} for p in others), {p.pid: _nices(p) for p in others}
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the serving glue keeps its priority


def _nices(process) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, t.id) for t in process.threads()}


def test_the_requests_for_vllms_own_nccl_engine_are_accepted_by_its_parsers():
    """What a worker hands vLLM's native ``nccl`` weight-transfer engine (refit_protocol="vllm",
    GPU fleets) is parsed by that engine's own parse_init_info / parse_update_info. The native
    transfer itself needs CUDA and does not run on this machine."""
    from types import SimpleNamespace

    from rollout_fleet.adapters.vllm.host.refit import native_init_info, native_update_info
    from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    parser = SimpleNamespace(init_info_cls=NCCLWeightTransferEngine.init_info_cls,
                             update_info_cls=NCCLWeightTransferEngine.update_info_cls)
    join = GroupJoin(host="10.0.0.5", port=29500, world_size=1 + 2 * 4, train_world_size=1,
                     first_rank=5, ranks_per_worker=4,
                     sender_spec=CollectiveSenderSpec(buffer_bytes=512 << 20, num_buffers=3))
    init = WeightTransferEngine.parse_init_info(parser, native_init_info(join))
    assert (init.master_address, init.master_port, init.rank_offset, init.world_size) == (
        "10.0.0.5", 29500, 5, 9)
    assert (init.packed, init.packed_buffer_size_bytes, init.packed_num_buffers) == (True, 512 << 20, 3)
    info = RefitInfo.from_state_dict_info({"model.norm.weight": ((128,), "bfloat16"),
                                           "lm_head.weight": ((1000, 128), "bfloat16")})
    update = WeightTransferEngine.parse_update_info(parser, native_update_info(info))
    assert update.names == ["model.norm.weight", "lm_head.weight"]
    assert update.dtype_names == ["bfloat16", "bfloat16"]
    assert update.shapes == [[128], [1000, 128]]
    with pytest.raises(ValueError):  # its own checks still run: lists of different lengths
        WeightTransferEngine.parse_update_info(parser, {**native_update_info(info), "shapes": [[1]]})


def test_vllms_own_protocol_is_refused_on_the_cpu_at_config_load():
    with pytest.raises(InvalidValue, match="refit_protocol.*needs GPUs"):
        VllmEngineConfig(model="/m", refit_protocol="vllm")


def test_config_defaults_per_device():
    cpu = VllmEngineConfig(model="/m").engine_kwargs()
    assert (cpu["dtype"], cpu["enforce_eager"], cpu["max_model_len"]) == ("float32", True, 512)
    assert cpu["kv_cache_memory_bytes"] == 64 * 2**20
    assert (cpu["enable_chunked_prefill"], cpu["max_num_batched_tokens"]) == (False, 2048)
    assert cpu["weight_transfer_config"] == {"backend": "rollout_fleet_packed"}
    gpu = VllmEngineConfig(model="/m", device="gpu").engine_kwargs()
    assert (gpu["dtype"], gpu["enforce_eager"]) == ("auto", False)
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu
    assert "max_model_len" not in gpu and gpu["weight_transfer_config"] == {"backend": "rollout_fleet_packed"}
    native = VllmEngineConfig(model="/m", device="gpu", refit_protocol="vllm").engine_kwargs()
    assert native["weight_transfer_config"] == {"backend": "nccl"}
    assert (VllmEngineConfig(model="/m").rollback, VllmEngineConfig(model="/m", device="gpu").rollback
            ) == ("last_good", "none")
    events = VllmEngineConfig(model="/m", kv_events_port=5600).engine_kwargs()["kv_events_config"]
    assert events["endpoint"].startswith("ipc://")  # a local socket, never vLLM's tcp://*
    assert events["endpoint"].endswith("-5600")


@pytest.mark.parametrize("config, field", [
    ({"model": "/m", "max_model_len": 0}, "max_model_len"),
    ({"model": "/m", "device": "tpu"}, "device"),
    ({"model": "/m", "no_such_key": 1}, "no_such_key"),
    ({"model": ""}, "model"),
    ({"model": "/m", "cpu_worker_nice": -5}, "cpu_worker_nice"),
    ({"model": "/m", "cpu_worker_nice": 20}, "cpu_worker_nice"),
    ({"model": "/m", "cpu_worker_nice": True}, "cpu_worker_nice"),
    ({"model": "/m", "cpu_cores": []}, "cpu_cores"),
    ({"model": "/m", "cpu_cores": [0, -1]}, "cpu_cores"),
    ({"model": "/m", "cpu_cores": ["0"]}, "cpu_cores"),
])
def test_bad_config_is_refused_by_field(config, field):
    with pytest.raises(InvalidValue) as refused:
        engine_from_config(config)
    assert refused.value.field == field


def test_cpu_cores_reach_vllm_only_while_its_engine_starts(monkeypatch):
    from rollout_fleet.adapters.vllm.host.process import pinned_to_cpus

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    with pinned_to_cpus(VllmEngineConfig(model="/m", cpu_cores=[2, 3]).omp_binding()):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    with pinned_to_cpus(VllmEngineConfig(model="/m", device="gpu", cpu_cores=[2]).omp_binding()):
        assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # only the CPU backend binds
