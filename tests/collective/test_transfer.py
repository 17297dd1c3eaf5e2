"""Real gloo groups across real processes: a trainer rank sends, two worker ranks receive.

Every outcome arrives before the harness deadline (which is well above each group's timeout),
so "no hang" is asserted by the outcome being there at all.
"""

from __future__ import annotations

import pytest
import torch

from rollout_fleet.adapters.collective.packing import as_bytes
from tests.collective import peers
from tests.collective.harness import free_port, run_ranks

pytestmark = pytest.mark.collective

DEADLINE_S = 90.0
NAMES = list(peers.make_state_dict(0))


def one_trainer_two_workers(trainer_kwargs: dict, worker_kwargs: list[dict], refits: list[dict],
                            world_size: int = 3) -> list[dict | None]:
    port = free_port()
    ranks = [(peers.trainer, dict(port=port, rank=0, world_size=world_size, refits=refits,
                                  **trainer_kwargs))]
    for rank, extra in enumerate(worker_kwargs, start=1):
        ranks.append((peers.worker, dict(port=port, rank=rank, world_size=world_size,
                                         refits=refits, **extra)))
    return run_ranks(ranks, DEADLINE_S)


def assert_refused(outcome: dict | None, error_type: str, *fragments: str) -> None:
    assert outcome is not None, "the rank hung or died instead of raising"
    assert not outcome["ok"], f"expected {error_type}, the rank succeeded: {outcome}"
    assert error_type in outcome["error_types"], outcome
    for fragment in fragments:
        assert fragment in outcome["message"], (fragment, outcome["message"])


def test_the_seeds_give_different_bytes_so_a_stale_buffer_would_show():
    first, second = peers.make_state_dict(1), peers.make_state_dict(2)
    assert not torch.equal(as_bytes(first["layer.1.big.weight"]),
                           as_bytes(second["layer.1.big.weight"]))


def test_every_tensor_arrives_bit_exact_for_each_geometry():
    # 1000 B buffers: most tensors exceed a buffer and travel alone; 1 MiB: one bucket.
    refits = [
        {"seed": 1, "buffer_bytes": 1000, "num_buffers": 1},
        {"seed": 2, "buffer_bytes": 1000, "num_buffers": 3},
        {"seed": 3, "buffer_bytes": 4096, "num_buffers": 2},
        {"seed": 4, "buffer_bytes": 65536, "num_buffers": 4},
        {"seed": 5, "buffer_bytes": 1 << 20, "num_buffers": 2},
    ]
    outcomes = one_trainer_two_workers({}, [{}, {}], refits)
    assert outcomes[0] is not None and outcomes[0]["ok"], outcomes[0]
    assert outcomes[0]["value"] == {"sent": len(refits), "is_sender": True}
    for outcome in outcomes[1:]:
        assert outcome is not None and outcome["ok"], outcome
        assert len(outcome["value"]) == len(refits)
        for report in outcome["value"]:
            assert report["names"] == NAMES  # refit info order
            assert report["mismatched"] == []


def test_other_trainer_ranks_join_and_send_nothing():
    port, refits = free_port(), [{"seed": 7, "buffer_bytes": 2048, "num_buffers": 2}]
    common = dict(port=port, world_size=4, refits=refits, train_world_size=2)
    outcomes = run_ranks([(peers.trainer, dict(rank=0, **common)),
                          (peers.trainer, dict(rank=1, **common)),
                          (peers.worker, dict(rank=2, **common)),
                          (peers.worker, dict(rank=3, **common))], DEADLINE_S)
    assert all(o is not None and o["ok"] for o in outcomes), outcomes
    assert outcomes[0]["value"]["is_sender"] and not outcomes[1]["value"]["is_sender"]
    for outcome in outcomes[2:]:
        assert outcome["value"] == [{"names": NAMES, "mismatched": []}]


@pytest.mark.parametrize("field, senders, theirs", [
    ("buffer_bytes", 4096, 2048),
    ("num_buffers", 2, 3),
])
def test_a_geometry_mismatch_is_the_same_clear_error_on_every_side(field, senders, theirs):
    sender_refit = {"seed": 1, "buffer_bytes": 4096, "num_buffers": 2, field: senders}
    odd_refit = dict(sender_refit, **{field: theirs})
    port = free_port()
    common = dict(port=port, world_size=3, timeout_s=20.0)
    outcomes = run_ranks([(peers.trainer, dict(rank=0, refits=[sender_refit], **common)),
                          (peers.worker, dict(rank=1, refits=[sender_refit], **common)),
                          (peers.worker, dict(rank=2, refits=[odd_refit], **common))], DEADLINE_S)
    for outcome in outcomes:
        assert_refused(outcome, "RefitError", "header check", f"rank 2 has {field}={theirs}",
                       f"the sender has {field}={senders}")


def test_a_different_refit_info_is_refused_on_every_side():
    refits = [{"seed": 1, "buffer_bytes": 4096, "num_buffers": 2}]
    outcomes = one_trainer_two_workers({"timeout_s": 20.0},
                                       [{"timeout_s": 20.0, "info_seed_shift": 1},
                                        {"timeout_s": 20.0}], refits)
    for outcome in outcomes:
        assert_refused(outcome, "RefitError", "rank 1 has a different refit_info")


def test_a_sender_that_dies_mid_transfer_gives_receivers_a_clear_error():
    refits = [{"seed": 1, "buffer_bytes": 1000, "num_buffers": 2}]
    outcomes = one_trainer_two_workers({"timeout_s": 15.0, "die_after_tensors": 6},
                                       [{"timeout_s": 15.0}, {"timeout_s": 15.0}], refits)
    assert outcomes[0] is None  # the trainer exited abruptly, reporting nothing
    for outcome in outcomes[1:]:
        assert_refused(outcome, "RefitError", "bucket", "failed")


def test_ranks_that_disagree_on_the_world_size_all_get_a_world_size_error():
    port = free_port()
    outcomes = run_ranks([(peers.joiner, dict(port=port, rank=0, world_size=3)),
                          (peers.joiner, dict(port=port, rank=1, world_size=4)),
                          (peers.joiner, dict(port=port, rank=2, world_size=3))], DEADLINE_S)
    for outcome in outcomes:
        assert_refused(outcome, "WorldSizeMismatch", "world_size", "rank 1 declared world_size=4")


def test_a_world_size_larger_than_the_ranks_that_come_times_out_naming_the_missing_rank():
    port = free_port()
    common = dict(port=port, world_size=4, timeout_s=3.0)
    outcomes = run_ranks([(peers.joiner, dict(rank=r, **common)) for r in range(3)], DEADLINE_S)
    for outcome in outcomes:
        assert_refused(outcome, "RefitError", "rank(s) 3 of world_size 4 did not join within 3s")


def test_a_worker_whose_trainer_never_comes_gets_a_clear_error():
    outcomes = run_ranks([(peers.joiner, dict(port=free_port(), rank=1, world_size=2,
                                              timeout_s=2.0))], DEADLINE_S)
    assert_refused(outcomes[0], "RefitError", "could not reach the group's store", "within 2s")
