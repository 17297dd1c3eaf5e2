"""The worker-control port's contract suite.

Provide a ``control_under_test`` fixture: a ``ControlUnderTest`` whose ``control`` reaches a
worker (or a fake of one) whose engine can be refit, serving the controls every such fleet
worker serves (``weight_version``, ``flush_cache``, ``prepare_refit_info``, ...).
For a control that carries the fleet's secret, ``SecretControlContract`` adds a check: its
fixture's ``intruder`` reaches the same worker with a wrong secret. The suite pins
what the driver relies on: an answer is a mapping with status ``ok``; a refusal of any kind
(no such control, a body the control refuses, a wrong secret) raises ``ControlRefused`` naming
what was wrong, and never comes back as an answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pytest
from rollout_fleet.core.errors import ControlRefused
from rollout_fleet.core.loop_thread import LoopThread
from rollout_fleet.ports.control import WorkerControl


@attrs.define
class ControlUnderTest:
    control: WorkerControl
    loop: LoopThread
    intruder: WorkerControl | None = None

    def call(self, name: str, body: Mapping[str, Any] | None = None,
             control: WorkerControl | None = None) -> Mapping[str, Any]:
        return self.loop.run((control or self.control).call(name, body or {}, timeout_s=30))


class ControlContract:
    def test_the_control_names_its_worker(self, control_under_test: ControlUnderTest) -> None:
        worker_id = control_under_test.control.worker_id
        assert isinstance(worker_id, str) and worker_id

    def test_a_relay_address_is_none_or_a_nonempty_string(
            self, control_under_test: ControlUnderTest) -> None:
        address = control_under_test.control.relay_address()
        assert address is None or (isinstance(address, str) and address)

    def test_a_control_answers_ok_with_its_fields(
            self, control_under_test: ControlUnderTest) -> None:
        version = control_under_test.call("weight_version")
        assert version["status"] == "ok" and isinstance(version["weight_version"], int)
        assert control_under_test.call("flush_cache")["status"] == "ok"

    def test_no_such_control_is_refused_by_name(self, control_under_test: ControlUnderTest) -> None:
        with pytest.raises(ControlRefused, match="no_such_control"):
            control_under_test.call("no_such_control")

    def test_a_body_the_control_refuses_raises(self, control_under_test: ControlUnderTest) -> None:
        with pytest.raises(ControlRefused, match="refit_info"):
            control_under_test.call("prepare_refit_info", {})



class SecretControlContract(ControlContract):
    """For a control that carries the fleet's secret: the fixture gives ``intruder``."""

    def test_a_wrong_secret_is_refused(self, control_under_test: ControlUnderTest) -> None:
        cut = control_under_test
        assert cut.intruder is not None, "give ControlUnderTest an intruder"
        with pytest.raises(ControlRefused, match="control_secret"):
            cut.call("weight_version", control=cut.intruder)
