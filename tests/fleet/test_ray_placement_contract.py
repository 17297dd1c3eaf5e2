"""The Ray placement (a placement group, a supervising actor per worker) passes the placement
contract, on a local Ray cluster shared by the module's tests."""

import pytest

from rollout_fleet.adapters.ray import RayPlacement
from rollout_fleet.ports.contracts.placement import PlacementContract

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture
def placement_under_test(ray_cluster):
    placement = RayPlacement(bundle={"CPU": 1}, ready_timeout_s=60)
    yield placement
    placement.stop()


class TestRayPlacement(PlacementContract):
    pass
