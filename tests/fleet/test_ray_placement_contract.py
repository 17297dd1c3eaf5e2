"""The Ray placement (a placement group, a supervising actor per worker) passes the placement
contract, on a local Ray cluster shared by the module's tests."""

import sys

import attrs
import pytest

from rollout_fleet.adapters.ray import RayPlacement
from rollout_fleet.adapters.ray.placement import PlacementError
from rollout_fleet.ports.contracts.placement import PlacementContract
from rollout_fleet.ports.placement import WorkerLaunch

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


@pytest.fixture
def given_groups(ray_cluster):
    """Placement groups reserved by someone else (as NeMo-RL's cluster does): 2 + 1 bundles."""
    from ray.util.placement_group import placement_group, remove_placement_group

    import ray

    groups = [placement_group([{"CPU": 1}] * 2), placement_group([{"CPU": 1}])]
    ray.get([g.ready() for g in groups], timeout=60)
    yield groups
    for group in groups:
        remove_placement_group(group)


class TestRayPlacementInGivenGroups(PlacementContract):
    """The same contract, the workers placed in the given groups' bundles."""

    @pytest.fixture
    def placement_under_test(self, given_groups):
        placement = RayPlacement(bundle={"CPU": 1}, ready_timeout_s=60, groups=given_groups)
        yield placement
        placement.stop()


def test_given_groups_take_the_workers_reserve_nothing_and_outlive_the_placement(
        given_groups, tmp_path):
    from ray.util import placement_group_table

    before = set(placement_group_table())
    placement = RayPlacement(bundle={"CPU": 1}, ready_timeout_s=60, groups=given_groups)
    try:
        placement.launch([_sleeper(tmp_path, f"w{i}") for i in range(3)])
        assert set(placement_group_table()) == before  # no group of its own
        with pytest.raises(PlacementError, match=r"room for 3 workers \(0 free\)"):
            placement.launch([_sleeper(tmp_path, "w3")])
        assert placement.alive() == {f"w{i}": True for i in range(3)}
    finally:
        placement.stop()
    states = {placement_group_table()[g.id.hex()]["state"] for g in given_groups}
    assert states == {"CREATED"}  # the owner's groups are left as they were


def test_a_given_group_that_does_not_split_into_workers_is_refused(given_groups):
    with pytest.raises(PlacementError, match="placement group 1 has 1 bundles, not a multiple"
                                             " of the 2 bundles of one worker"):
        RayPlacement(groups=given_groups, bundles_per_worker=2)


def _sleeper(tmp_path, name: str) -> WorkerLaunch:
    return WorkerLaunch(name=name, argv=(sys.executable, "-c", "import time; time.sleep(600)"),
                        log_path=str(tmp_path / f"{name}.log"))


def test_a_launch_that_cannot_reserve_leaves_the_placed_workers_running(ray_cluster, tmp_path):
    # The cluster has 4 CPUs. A refused reservation is given up after 3 s; a busy machine
    # may take longer than that to start a worker's supervisor.
    placement = RayPlacement(bundle={"CPU": 1}, reserve_timeout_s=3, ready_timeout_s=60)
    try:
        placement.launch([_sleeper(tmp_path, "w0")])
        with pytest.raises(PlacementError, match=r"could not reserve 4 bundles"):
            placement.launch([_sleeper(tmp_path, f"more{i}") for i in range(4)])
        assert placement.alive() == {"w0": True}
        from ray.util import placement_group_table

        states = [group["state"] for group in placement_group_table().values()]
        assert "PENDING" not in states, states  # the refused one waits for nothing
        # The 3 CPUs left take 3 more workers.
        added = placement.launch([_sleeper(tmp_path, f"w{i}") for i in (1, 2, 3)])
        assert [(h.index, h.name) for h in added] == [(1, "w1"), (2, "w2"), (3, "w3")]
        assert placement.alive() == {f"w{i}": True for i in range(4)}
    finally:
        placement.stop()


def test_a_replacement_takes_the_lost_workers_bundle_on_a_full_cluster(ray_cluster, tmp_path):
    """Every CPU of the cluster reserved: a replacement needs no new resources, it takes the
    reservation of the worker it replaces."""
    placement = RayPlacement(bundle={"CPU": 1}, reserve_timeout_s=5,
                             ready_timeout_s=60)  # the cluster has 4 CPUs
    try:
        placement.launch([_sleeper(tmp_path, f"w{i}") for i in range(4)])
        with pytest.raises(PlacementError, match=r"could not reserve 1 bundles"):
            placement.launch([_sleeper(tmp_path, "more")])
        placement.kill("w2")
        (w4,) = placement.launch([attrs.evolve(_sleeper(tmp_path, "w4"), in_place_of="w2")])
        assert w4.index == 4
        assert placement.alive() == {"w0": True, "w1": True, "w2": False, "w3": True, "w4": True}
    finally:
        placement.stop()
