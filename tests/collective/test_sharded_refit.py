"""A many-source sharded refit over real gloo processes: 4 trainer ranks holding dim-0 shards
(two of them handing over DTensors) -> 2 workers x tensor parallel 2 (8 processes); every engine
rank receives exactly its slices, bit-exact, twice, within its bounded blocks; an engine rank
that declares another layout makes every rank fail with the same clear error."""

from __future__ import annotations

import pytest

from tests.collective import sharded_peers as peers
from tests.collective.harness import free_port, run_ranks

pytestmark = pytest.mark.collective
T, WORKERS, TP = 4, 2, 2
WORLD = T + WORKERS * TP


def ranks(port, seeds, *, declared_tp=None, dtensor_port=None):
    common = dict(world_size=WORLD, train_world_size=T, workers=WORKERS, tp=TP, seeds=seeds)
    return ([(peers.trainer, dict(port=port, rank=r, dtensor_port=dtensor_port, **common))
             for r in range(T)]
            + [(peers.engine_rank, dict(port=port, rank=T + g,
                                        declared_tp=declared_tp if g == 3 else None, **common))
               for g in range(WORKERS * TP)])


def test_four_trainer_ranks_refit_two_tensor_parallel_workers_bit_exact():
    outcomes = run_ranks(ranks(free_port(), [1, 2], dtensor_port=free_port()), deadline_s=120)
    assert all(o is not None and o["ok"] for o in outcomes), [o and o.get("message") for o in outcomes]
    info, _, _ = peers.declarations(T, WORKERS, TP)
    names = [m.name for m in info.tensors]
    for outcome in outcomes[T:]:
        for refit in outcome["value"]["refits"]:
            assert refit["names"] == names and refit["mismatched"] == []
            assert refit["peak"] <= refit["bound"], refit
    sent = [o["value"]["sent_bytes"][0] for o in outcomes[:T]]
    assert all(sent) and max(sent) <= 1.1 * sum(sent) / T, sent


def test_an_engine_rank_with_another_layout_fails_every_rank_with_one_error():
    outcomes = run_ranks(ranks(free_port(), [1], declared_tp=1), deadline_s=120)
    assert all(o is not None and not o["ok"] for o in outcomes), outcomes
    assert all("disagree on the sharded refit" in o["message"] for o in outcomes), \
        [o["message"] for o in outcomes]
