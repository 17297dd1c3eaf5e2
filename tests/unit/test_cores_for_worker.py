"""How a local fleet shares this host's cores among its vLLM CPU workers."""

import pytest

from rollout_fleet.wiring.engines import cores_for_worker


@pytest.mark.parametrize("cores, workers, expected", [
    ([0, 1], 2, [[0], [1]]),
    ([0, 1, 2, 3, 4, 5, 6, 7], 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ([0, 1, 2, 3, 4], 2, [[0, 1], [2, 3]]),  # the odd core is left to the frontend and driver
    ([2, 5], 3, [[2], [5], [2]]),  # more workers than cores: one each, round-robin
    ([7], 1, [[7]]),
])
def test_each_worker_gets_its_own_slice_and_none_is_empty(cores, workers, expected):
    assert [cores_for_worker(cores, workers, i) for i in range(workers)] == expected
