"""The local placement (child processes on this machine) passes the placement contract."""

import pytest

from rollout_fleet.adapters.local import LocalPlacement
from rollout_fleet.ports.contracts.placement import PlacementContract


@pytest.fixture
def placement_under_test():
    placement = LocalPlacement(stop_grace_s=5.0)
    yield placement
    placement.stop()


class TestLocalPlacement(PlacementContract):
    pass
