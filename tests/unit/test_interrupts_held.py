"""A signal that unwinds a start never lands between a child's start and its recording: inside
``interrupts_held`` the handler's interrupt waits for the block's end."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from rollout_fleet.adapters.shared.processes import interrupt, interrupts_held


@pytest.fixture
def usr1_interrupts():
    previous = signal.signal(signal.SIGUSR1, lambda *_: interrupt())
    yield lambda: os.kill(os.getpid(), signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, previous)


def test_outside_a_block_the_interrupt_comes_at_once(usr1_interrupts):
    with pytest.raises(KeyboardInterrupt):
        usr1_interrupts()
        for _ in range(10_000):  # the handler runs at the next bytecode boundary
            pass
        pytest.fail("no interrupt")


def test_inside_nested_blocks_it_comes_after_the_outermost_ends(usr1_interrupts):
    recorded = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            with interrupts_held():
                usr1_interrupts()
                for _ in range(10_000):
                    pass
                recorded.append("child")
            recorded.append("after inner")
        recorded.append("after outer")
    assert recorded == ["child", "after inner"]


def test_a_block_that_raises_keeps_its_own_error_and_leaves_nothing_pending(usr1_interrupts):
    with pytest.raises(ValueError):
        with interrupts_held():
            usr1_interrupts()
            for _ in range(10_000):
                pass
            raise ValueError("start failed")
    with interrupts_held():  # the dropped interrupt does not fire here later
        pass


def test_in_another_thread_the_block_holds_nothing():
    outcome = []

    def other() -> None:
        try:
            with interrupts_held():
                interrupt()  # no signal handler runs here; nothing of the main thread's is held
                outcome.append("held")
        except KeyboardInterrupt:
            outcome.append("raised at once")

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert outcome == ["raised at once"]
