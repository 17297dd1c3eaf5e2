"""The in-memory token staging passes the token-staging contract (TransferQueue's store passes
it in tests/transfer_queue, against a real TransferQueue)."""

import pytest

from rollout_fleet.adapters.transfer_queue import InMemoryStaging
from rollout_fleet.ports.contracts.token_staging import TokenStagingContract


class TestInMemoryStaging(TokenStagingContract):
    @pytest.fixture
    def staging_under_test(self):
        return InMemoryStaging()
