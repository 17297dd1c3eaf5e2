import multiprocessing

import pytest

from tests.collective.harness import stop_forkserver


@pytest.fixture(scope="session", autouse=True)
def no_rank_process_left_behind():
    yield
    stop_forkserver()
    assert multiprocessing.active_children() == []
