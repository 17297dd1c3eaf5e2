"""The local placement (processes on this machine) passes the placement contract, with each
worker started as a new process and with each forked from a worker template."""

import pytest

from rollout_fleet.adapters.local import LocalPlacement
from rollout_fleet.ports.contracts.placement import PlacementContract


class TestLocalPlacement(PlacementContract):
    @pytest.fixture
    def placement_under_test(self):
        placement = LocalPlacement(stop_grace_s=5.0)
        yield placement
        placement.stop()


class TestForkedLocalPlacement(PlacementContract):
    @pytest.fixture
    def placement_under_test(self):
        placement = LocalPlacement(stop_grace_s=5.0, start="fork", preload=("json",))
        yield placement
        placement.stop()
