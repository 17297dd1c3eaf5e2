"""The weight sender / receiver contract suite.

Provide a ``collective_under_test`` fixture returning a ``CollectiveUnderTest``: a way to build
one sender and N receivers on a fresh group (threads run the ranks, so an adapter whose ranks
can share a process, like gloo groups built without the default group, runs here as is).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import pytest
from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo
from rollout_fleet.ports.collective import WeightReceiver, WeightSender


@attrs.define
class CollectiveUnderTest:
    # (sender_spec, receiver_specs) -> (sender, receivers); each call makes a fresh group.
    make_group: Callable[[CollectiveSenderSpec, Sequence[CollectiveSenderSpec]],
                         tuple[WeightSender, list[WeightReceiver]]]
    state_dict: Callable[[], tuple[RefitInfo, dict[str, Any]]]  # mixed dtypes and shapes
    same: Callable[[Any, Any], bool]  # bit-exact equality of two tensors


Received = list[tuple[str, Any]]  # one receiver's (name, tensor) in arrival order


def _run_ranks(sender: WeightSender, receivers: Sequence[WeightReceiver], info: RefitInfo,
               tensors: Mapping[str, Any], receiver_info: RefitInfo | None = None
               ) -> tuple[list[Received | None], list[BaseException | None]]:
    """Every rank in a thread of its own: what each receiver got, and each rank's error
    (the receivers', then the sender's)."""
    received: list[Received | None] = [None] * len(receivers)
    errors: list[BaseException | None] = [None] * (len(receivers) + 1)

    def receive(i: int) -> None:
        try:
            received[i] = list(receivers[i].receive(receiver_info or info))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[i] = exc

    def send() -> None:
        try:
            sender.send(info, tensors.items())
        except BaseException as exc:  # noqa: BLE001
            errors[-1] = exc

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(len(receivers))]
    threads.append(threading.Thread(target=send))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung past 120 s"
    return received, errors


class CollectiveContract:
    @pytest.mark.parametrize("buffer_bytes, num_buffers", [(1 << 10, 1), (4 << 10, 2), (1 << 20, 3)])
    def test_every_tensor_arrives_bit_exact_in_order(self, collective_under_test: CollectiveUnderTest,
                                                     buffer_bytes: int, num_buffers: int) -> None:
        cut = collective_under_test
        spec = CollectiveSenderSpec(buffer_bytes=buffer_bytes, num_buffers=num_buffers)
        sender, receivers = cut.make_group(spec, [spec, spec])
        info, tensors = cut.state_dict()
        try:
            received, errors = _run_ranks(sender, receivers, info, tensors)
        finally:
            _close(sender, receivers)
        assert errors == [None] * 3
        for got in received:
            assert got is not None
            assert [name for name, _ in got] == [t.name for t in info.tensors]
            for name, tensor in got:
                assert cut.same(tensor, tensors[name]), f"{name} differs"

    def test_a_geometry_mismatch_is_a_clear_error_not_a_hang(
            self, collective_under_test: CollectiveUnderTest) -> None:
        cut = collective_under_test
        spec = CollectiveSenderSpec(buffer_bytes=4096, num_buffers=2)
        other = CollectiveSenderSpec(buffer_bytes=8192, num_buffers=2)
        sender, receivers = cut.make_group(spec, [other])
        info, tensors = cut.state_dict()
        try:
            _, errors = _run_ranks(sender, receivers, info, tensors)
        finally:
            _close(sender, receivers)
        assert isinstance(errors[0], RolloutFleetError), errors

    def test_a_refit_info_mismatch_is_a_clear_error(
            self, collective_under_test: CollectiveUnderTest) -> None:
        cut = collective_under_test
        spec = CollectiveSenderSpec(buffer_bytes=4096, num_buffers=2)
        sender, receivers = cut.make_group(spec, [spec])
        info, tensors = cut.state_dict()
        fewer = RefitInfo(info.tensors[:-1], info.packed)
        try:
            _, errors = _run_ranks(sender, receivers, info, tensors, receiver_info=fewer)
        finally:
            _close(sender, receivers)
        assert isinstance(errors[0], RolloutFleetError), errors


def _close(sender: WeightSender, receivers: Sequence[WeightReceiver]) -> None:
    sender.close()
    for receiver in receivers:
        receiver.close()
