"""The in-memory refit group of a unit test, behind one stable ``join_receiver``: engines keep
that reference, and a test swaps ``collective`` for a fresh group (as a trainer forming a new
one) before each refit."""

from __future__ import annotations

from rollout_fleet.adapters.memory import MemoryCollective


class SwappableGroup:
    def __init__(self) -> None:
        self.collective = MemoryCollective()

    def join_receiver(self, join, engine_rank: int = 0):
        return self.collective.join_receiver(join, engine_rank)
