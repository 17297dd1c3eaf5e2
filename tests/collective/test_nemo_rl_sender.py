"""NeMo-RL's trainer refits workers of the "vllm" protocol unchanged: its rendezvous, warm-up and
packed byte stream (re-implemented in support/nemo_rl_sender.py from reading NeMo-RL)
against what the fleet's workers hand vLLM's own NCCL weight-transfer engine (the init and
update info the driver plans), with gloo in NCCL's place on the CPU. Two trainer ranks, two
workers of two engine ranks each, a tied-embedding model's state dict, buffers small enough
that tensors cross buffer boundaries."""

from __future__ import annotations


from rollout_fleet.adapters.memory.control import LocalWorkerControl
from rollout_fleet.adapters.vllm.host.refit import native_init_info, native_update_info
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, RefitInfo, RefitProtocol
from rollout_fleet.core.refit_service import RefitCoordinator
from tests.collective.harness import free_port, run_ranks
from support.nemo_rl_sender import digest, trainer_rank, trainer_state_dict
from tests.support.vllm_receiver import worker

TRAINER_RANKS, WORKERS, ENGINE_RANKS, SEED = 2, 2, 2, 3
HOST = "127.0.0.1"


def planned_joins(port: int, spec: CollectiveSenderSpec) -> list[GroupJoin]:
    """What the driver asks each worker for NeMo-RL's ``init_collective`` call."""
    controls = [LocalWorkerControl(f"worker-{i}", {}) for i in range(WORKERS)]
    coordinator = RefitCoordinator(controls, ranks_per_worker=ENGINE_RANKS, timeout_s=60)
    world_size = TRAINER_RANKS + WORKERS * ENGINE_RANKS
    calls = coordinator.init_collective_plan(HOST, port, world_size, TRAINER_RANKS, spec)
    return [GroupJoin.from_wire(call.body) for call in calls]


def test_vllm_protocol_workers_receive_exactly_what_nemo_rls_trainer_sends():
    import vllm  # noqa: F401 - a missing vLLM fails here, by name

    spec = CollectiveSenderSpec(protocol=RefitProtocol.VLLM, buffer_bytes=100_000, num_buffers=2)
    port = free_port()
    world_size = TRAINER_RANKS + WORKERS * ENGINE_RANKS
    weights = trainer_state_dict(SEED)
    info = RefitInfo.from_state_dict_info({n: (tuple(t.shape), t.dtype) for n, t in weights.items()})
    update_info = native_update_info(info)
    ranks = [(trainer_rank, {"host": HOST, "port": port, "rank": rank, "world_size": world_size,
                             "seed": SEED, "buffer_size_bytes": spec.buffer_bytes})
             for rank in range(TRAINER_RANKS)]
    ranks += [(worker, {"init_info": native_init_info(join), "update_info": update_info,
                        "ranks": ENGINE_RANKS}) for join in planned_joins(port, spec)]
    outcomes = run_ranks(ranks, deadline_s=300)
    assert all(o is not None and o["ok"] for o in outcomes), outcomes
    trainers, workers = outcomes[:TRAINER_RANKS], outcomes[TRAINER_RANKS:]
    sender = trainers[0]
    assert sender["buffers"] > 3, "the buffers were too big to test their boundaries"
    expected = [(name, "torch.bfloat16", list(t.shape), digest(t)) for name, t in weights.items()]
    assert "lm_head.weight" in {name for name, *_ in expected}  # the tied name NeMo-RL sends
    engine_ranks = [rank for w in workers for rank in w["ranks"]]
    # NeMo-RL's layout: the trainer's ranks first, worker i's engine ranks at T + i*E + j
    assert [r["rank"] for r in engine_ranks] == list(range(TRAINER_RANKS, world_size))
    for received in engine_ranks:
        # vLLM's receiver read the trainer's unique id, as vLLM's own type, from NeMo-RL's key
        assert received["unique_id"] == sender["unique_id"]
        assert received["unique_id_type"].endswith("pynccl_wrapper.ncclUniqueId")
        assert received["buffers"] == sender["buffers"]  # the same cuts on both sides
        assert received["loaded"] == expected  # every tensor, in order, bit for bit
