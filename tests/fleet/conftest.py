"""Fleet tests start a real local Ray cluster, whose daemons bind every interface: they run only
inside a private network namespace (scripts/test.sh puts the whole suite in one)."""

import pytest

from tests.support.net import in_private_netns


@pytest.fixture(autouse=True, scope="session")
def _private_network():
    if not in_private_netns():
        pytest.fail("fleet tests start a local Ray cluster (it binds 0.0.0.0): run them through "
                    "scripts/test.sh, which runs pytest inside `unshare -n` (loopback only)")
