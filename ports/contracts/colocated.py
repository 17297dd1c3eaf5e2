"""The colocated refit's contract suite, for engines that implement ``ColocatedTarget``.

Usage, beside the refit suite (``ports.contracts.engine``)::

    class TestMyEngine(EngineContract, RefitTargetContract, ColocatedContract):
        ...  # fixtures: engine_under_test, weight_sets, colocated_trainer

``colocated_trainer`` is a ``ColocatedTrainer`` built by the adapter's tests: a trainer in
another process that owns the shared buffers and sends one refit per ``refit`` call, its
control calls answered through ``call`` (the worker's controls, run here by the suite).
The suite drives the engine through the worker's colocated controls
(``core.colocated_service.WorkerColocatedRefit``), so every engine meets the same session.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import pytest
from rollout_fleet.core.colocated_refit import ColocatedSession
from rollout_fleet.core.colocated_service import WorkerColocatedRefit
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.ports.colocated import ColocatedTarget
from rollout_fleet.ports.contracts.harness import EngineUnderTest
from rollout_fleet.ports.contracts.refit_target import WeightSets

IDLE_TIMEOUT_S = 3.0  # the suite's session expiry: a dead trainer is given up within it
# faults a ColocatedTrainer injects (its own side of the protocol, never the engine's):
WRONG_SHAPE = "wrong_shape"  # the named tensor offered with another shape
DIE_AFTER_BUCKET = "die_after_bucket"  # the trainer process exits after bucket 0's answer
UNLINK_BEFORE_BUCKET = "unlink_before_bucket"  # bucket 1's buffer is gone before the call


_SERVICES: weakref.WeakKeyDictionary[Any, WorkerColocatedRefit] = weakref.WeakKeyDictionary()
GREEDY_TOKENS = 12  # each prompt's greedy answer, compared before a refit and after
Caller = Callable[[str, Mapping[str, Any]], Mapping[str, Any]]  # a control's name, body -> answer


def _greedy(eut: EngineUnderTest) -> list[tuple[int, ...]]:
    return eut.greedy_answers(GREEDY_TOKENS)


@attrs.frozen
class Serving:
    """What an engine serves: each prompt's greedy answer, at its weight version. A refit
    refused or failed leaves it as it was."""

    answers: tuple[tuple[int, ...], ...]
    version: int


class TrainerDied(RolloutFleetError):
    """The trainer process ended in the middle of a refit."""


@attrs.frozen
class ColocatedTrainer:
    """``refit(call, tensors, version=None, fault=None, fault_arg=None, in_place=False)``: one
    refit of the state dict ``tensors`` from the trainer's process (``in_place``: the tensors
    held in the sender's buffers, one a bucket, every bucket sent in one call);
    ``call(name, body) -> answer`` reaches the worker's controls. Returns the finish's answer;
    raises what the worker refused with, or ``TrainerDied``. ``buckets_per_refit``: how many buckets a refit of the weight sets
    takes with the trainer's buffer size (the suite needs at least 2)."""

    refit: Callable[..., Mapping[str, Any]]
    buckets_per_refit: int


class ColocatedContract:
    def _colocated_service(self, eut: EngineUnderTest) -> WorkerColocatedRefit:
        target = self._colocated_target(eut)
        service = _SERVICES.get(target)
        if service is None:
            service = _SERVICES[target] = WorkerColocatedRefit(target,
                                                               idle_timeout_s=IDLE_TIMEOUT_S)
        return service

    def _colocated_caller(self, eut: EngineUnderTest) -> Caller:
        controls = self._colocated_service(eut).controls()

        async def call(name: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
            return await controls[name](dict(body))
        return lambda name, body: eut.loop.run(call(name, body))

    def _colocated_target(self, eut: EngineUnderTest) -> ColocatedTarget:
        assert isinstance(eut.engine, ColocatedTarget), \
            "the engine does not implement ColocatedTarget"
        return eut.engine

    def _version(self, eut: EngineUnderTest) -> int:
        return self._colocated_target(eut).weight_version()

    def _serving(self, eut: EngineUnderTest) -> Serving:
        return Serving(tuple(_greedy(eut)), self._version(eut))

    def _colocated_refit(self, eut: EngineUnderTest, trainer: ColocatedTrainer,
                         tensors: Mapping[str, Any], **kw: Any) -> Mapping[str, Any]:
        return trainer.refit(self._colocated_caller(eut), tensors, **kw)

    def _given_up(self, eut: EngineUnderTest) -> ColocatedSession:
        """The session a dead trainer left, once the worker gave it up (or the wait ran out)."""
        session = self._colocated_service(eut).session
        assert session is not None, "no colocated refit was started"
        deadline = time.monotonic() + IDLE_TIMEOUT_S + 30
        while session.is_open and time.monotonic() < deadline:
            time.sleep(0.1)
        return session

    def test_a_refit_crosses_several_buckets(self, colocated_trainer: ColocatedTrainer) -> None:
        assert colocated_trainer.buckets_per_refit >= 2

    def test_a_colocated_refit_changes_outputs_and_refitting_back_restores_them(
            self, engine_under_test: EngineUnderTest, weight_sets: WeightSets,
            colocated_trainer: ColocatedTrainer) -> None:
        eut, (original, alternate) = engine_under_test, weight_sets
        before, version = _greedy(eut), self._version(eut)
        answer = self._colocated_refit(eut, colocated_trainer, alternate)
        assert answer["weight_version"] == version + 1
        assert answer["buckets"] == colocated_trainer.buckets_per_refit
        assert _greedy(eut) != before, "a colocated refit of other weights changed nothing"
        assert self._colocated_refit(eut, colocated_trainer, original)["weight_version"] == version + 2
        assert _greedy(eut) == before, "refitting the original back did not restore it"

    def test_an_in_place_refit_loads_every_bucket_from_one_call(
            self, engine_under_test: EngineUnderTest, weight_sets: WeightSets,
            colocated_trainer: ColocatedTrainer) -> None:
        eut, (original, alternate) = engine_under_test, weight_sets
        before, version = _greedy(eut), self._version(eut)
        caller = self._colocated_caller(eut)
        calls: list[str] = []

        def counted(name: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
            calls.append(name)
            return caller(name, body)
        answer = colocated_trainer.refit(counted, alternate, in_place=True)
        assert answer["weight_version"] == version + 1
        assert answer["buckets"] == colocated_trainer.buckets_per_refit
        assert calls[:3] == ["colocated_start", "colocated_buckets", "colocated_finish"]
        assert _greedy(eut) != before, \
            "an in-place refit of other weights changed nothing"
        colocated_trainer.refit(counted, original, in_place=True)
        assert _greedy(eut) == before, "refitting the original back did not restore it"

    def test_the_fleet_version_is_taken_and_one_going_backwards_refused(
            self, engine_under_test: EngineUnderTest, weight_sets: WeightSets,
            colocated_trainer: ColocatedTrainer) -> None:
        eut, (original, alternate) = engine_under_test, weight_sets
        wanted = self._version(eut) + 3
        answer = self._colocated_refit(eut, colocated_trainer, alternate, version=wanted)
        assert answer["weight_version"] == wanted
        with pytest.raises(RolloutFleetError, match="weight_version"):
            self._colocated_refit(eut, colocated_trainer, original, version=wanted)
        assert self._version(eut) == wanted
        assert self._colocated_refit(eut, colocated_trainer, original)["weight_version"] == wanted + 1

    def test_a_wrong_shape_is_refused_naming_the_tensor_and_nothing_changes(
            self, engine_under_test: EngineUnderTest, weight_sets: WeightSets,
            colocated_trainer: ColocatedTrainer) -> None:
        eut, (original, _alternate) = engine_under_test, weight_sets
        before = self._serving(eut)
        name = sorted(original)[-1]
        with pytest.raises(RolloutFleetError, match=f"shape of '{name}'"):
            self._colocated_refit(eut, colocated_trainer, original, fault=WRONG_SHAPE,
                                  fault_arg=name)
        assert self._serving(eut) == before, "a refused colocated refit changed what it serves"

    def test_a_buffer_gone_mid_refit_fails_it_and_the_old_weights_serve(
            self, engine_under_test: EngineUnderTest, weight_sets: WeightSets,
            colocated_trainer: ColocatedTrainer) -> None:
        eut, (original, alternate) = engine_under_test, weight_sets
        before = self._serving(eut)
        with pytest.raises(RolloutFleetError, match="segment|handle"):
            self._colocated_refit(eut, colocated_trainer, alternate, fault=UNLINK_BEFORE_BUCKET)
        assert self._serving(eut) == before, "a failed colocated refit changed what it serves"
        for tensors, version in ((alternate, before.version + 1), (original, before.version + 2)):
            assert self._colocated_refit(eut, colocated_trainer, tensors)["weight_version"] == version
        assert _greedy(eut) == list(before.answers)

    def test_a_trainer_dying_between_buckets_is_given_up_and_the_old_weights_serve(
            self, engine_under_test: EngineUnderTest, weight_sets: WeightSets,
            colocated_trainer: ColocatedTrainer) -> None:
        eut, (original, alternate) = engine_under_test, weight_sets
        before = self._serving(eut)
        with pytest.raises(TrainerDied):
            self._colocated_refit(eut, colocated_trainer, alternate, fault=DIE_AFTER_BUCKET)
        session = self._given_up(eut)
        assert not session.is_open, "the dead trainer's session was never given up"
        assert "the trainer is gone" in (session.failure or "")
        assert self._serving(eut) == before, "a given-up colocated refit changed what it serves"
        answer = self._colocated_refit(eut, colocated_trainer, original)
        assert answer["weight_version"] == before.version + 1
        assert _greedy(eut) == list(before.answers)
