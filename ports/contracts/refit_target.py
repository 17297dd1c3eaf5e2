"""The refit port's contract suite, for engines that also implement ``RefitTarget``::

    from rollout_fleet.ports.contracts.refit_target import RefitTargetContract, RefitTrainer

    class TestMyEngineRefit(RefitTargetContract):
        ...  # engine_under_test (ports/contracts/engine.py), weight_sets, refit_trainer

(``rollout_fleet.ports.contracts.engine`` exports both names too.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import pytest
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, RefitInfo, RefitProtocol
from rollout_fleet.ports.contracts.harness import EngineUnderTest
from rollout_fleet.ports.engine import RefitTarget

StateDict = Mapping[str, Any]  # parameter name -> tensor (the trainer's)
WeightSets = tuple[StateDict, StateDict]  # (original, alternate)


@attrs.define
class RefitTrainer:
    """The trainer end of refits for the ``RefitTargetContract``, built by an adapter's tests:
    ``open(ranks_per_worker)`` starts a trainer rank 0 on a fresh group (it waits for the
    engine's ranks in the background) and returns the join to hand the engine;
    ``send(info, tensors)`` sends one refit; ``send_then_die(info, tensors)`` sends the refit
    info's header and part of its tensors, then leaves the group (a trainer that died)."""

    open: Callable[[int], GroupJoin]
    send: Callable[[RefitInfo, Any], None]
    send_then_die: Callable[[RefitInfo, Any], None]
    close: Callable[[], None]


@attrs.frozen
class RefitStart:
    """Where a refit test starts, the engine joined to a fresh group: its refit port, both
    weight sets, the refit info of the alternate one, and its greedy answers and version."""

    target: RefitTarget
    original: StateDict
    alternate: StateDict
    info: RefitInfo
    before: list[tuple[int, ...]]
    version: int


class RefitTargetContract:
    """Tests for engines that also implement ``RefitTarget``.

    Provide ``engine_under_test`` (as above), ``weight_sets``: ``(original, alternate)`` state
    dicts (name -> tensor) that give different greedy outputs and cover every name in
    ``weight_metas()``, and ``refit_trainer``: a ``RefitTrainer``. The suite restores the
    original weights at the end of each test.
    """

    def _target(self, eut: EngineUnderTest) -> RefitTarget:
        assert isinstance(eut.engine, RefitTarget), "the engine does not implement RefitTarget"
        return eut.engine

    def _refit(self, eut: EngineUnderTest, trainer: RefitTrainer, info: RefitInfo,
               tensors: StateDict, send: Callable[[RefitInfo, Any], None] | None = None,
               version: int | None = None) -> int:
        target = self._target(eut)
        pending = asyncio.run_coroutine_threadsafe(target.update_weights(info, version=version),
                                                   eut.loop.loop)
        (send or trainer.send)(info, tensors)
        return pending.result(300)

    def _joined(self, eut: EngineUnderTest, trainer: RefitTrainer) -> None:
        target = self._target(eut)
        join = trainer.open(target.refit_ranks())
        eut.loop.run(target.init_collective(join))

    def _start(self, eut: EngineUnderTest, weight_sets: WeightSets,
               trainer: RefitTrainer) -> RefitStart:
        target = self._target(eut)
        original, alternate = weight_sets
        self._joined(eut, trainer)
        return RefitStart(target, original, alternate, _info_of(alternate, target),
                          eut.greedy_answers(12), target.weight_version())

    def test_metas_cover_the_weight_sets(self, engine_under_test: EngineUnderTest,
                                         weight_sets: WeightSets) -> None:
        metas = self._target(engine_under_test).weight_metas()
        original, alternate = weight_sets
        assert metas and set(original) == set(metas) == set(alternate)

    def test_refit_changes_outputs_and_refitting_back_restores_them(
            self, engine_under_test: EngineUnderTest, weight_sets: WeightSets,
            refit_trainer: RefitTrainer) -> None:
        eut = engine_under_test
        start = self._start(eut, weight_sets, refit_trainer)
        assert self._refit(eut, refit_trainer, start.info, start.alternate) == start.version + 1
        changed = eut.greedy_answers(12)
        assert changed != start.before, "refitting other weights did not change any greedy answer"
        assert self._refit(eut, refit_trainer, start.info, start.original) == start.version + 2
        assert eut.greedy_answers(12) == start.before, \
            "refitting the original back did not restore it"
        assert start.target.weight_version() == start.version + 2

    def test_a_refit_given_the_fleet_version_takes_it(
            self, engine_under_test: EngineUnderTest, weight_sets: WeightSets,
            refit_trainer: RefitTrainer) -> None:
        """A worker that joined a refit fleet late takes the fleet's version, not its own + 1."""
        eut = engine_under_test
        start = self._start(eut, weight_sets, refit_trainer)
        wanted = start.version + 5
        assert self._refit(eut, refit_trainer, start.info, start.alternate, version=wanted) == wanted
        assert start.target.weight_version() == wanted
        assert self._refit(eut, refit_trainer, start.info, start.original) == wanted + 1

    def test_a_trainer_dying_mid_transfer_leaves_the_old_weights(
            self, engine_under_test: EngineUnderTest, weight_sets: WeightSets,
            refit_trainer: RefitTrainer) -> None:
        eut = engine_under_test
        start = self._start(eut, weight_sets, refit_trainer)
        with pytest.raises(RolloutFleetError):
            self._refit(eut, refit_trainer, start.info, start.alternate,
                        send=refit_trainer.send_then_die)
        assert start.target.weight_version() == start.version
        assert eut.greedy_answers(12) == start.before, "a failed refit changed the answers"
        self._joined(eut, refit_trainer)  # a new group: the next refit works
        assert self._refit(eut, refit_trainer, start.info, start.alternate) == start.version + 1
        assert eut.greedy_answers(12) != start.before
        assert self._refit(eut, refit_trainer, start.info, start.original) == start.version + 2
        assert eut.greedy_answers(12) == start.before

    def test_a_join_for_another_rank_count_is_refused(
            self, engine_under_test: EngineUnderTest) -> None:
        target = self._target(engine_under_test)
        ranks = target.refit_ranks()
        join = GroupJoin(host="127.0.0.1", port=1, world_size=2 + ranks, train_world_size=1,
                         first_rank=1, ranks_per_worker=ranks + 1, timeout_s=2.0, backend="gloo")
        with pytest.raises(RolloutFleetError, match="ranks_per_worker"):
            engine_under_test.loop.run(target.init_collective(join))

    def test_a_join_in_a_protocol_the_engine_does_not_speak_is_refused(
            self, engine_under_test: EngineUnderTest) -> None:
        target = self._target(engine_under_test)
        ranks = target.refit_ranks()
        join = GroupJoin(host="127.0.0.1", port=1, world_size=1 + ranks, train_world_size=1,
                         first_rank=1, ranks_per_worker=ranks, timeout_s=2.0, backend="gloo",
                         # no engine receives the colocated protocol over a refit group
                         sender_spec=CollectiveSenderSpec(protocol=RefitProtocol.COLOCATED))
        with pytest.raises(RolloutFleetError, match="protocol"):
            engine_under_test.loop.run(target.init_collective(join))

    def test_reset_cache_keeps_answers(self, engine_under_test: EngineUnderTest) -> None:
        target = self._target(engine_under_test)
        before = engine_under_test.greedy_answers(12)
        engine_under_test.loop.run(target.reset_cache())
        assert engine_under_test.greedy_answers(12) == before


def _info_of(tensors: StateDict, target: RefitTarget) -> RefitInfo:
    """The refit info of a state dict, with the engine's dtypes and shapes (names in its order)."""
    metas = target.weight_metas()
    return RefitInfo(tuple(metas[name] for name in tensors))
