"""Who relays which piece of a refit to whom: two binary trees over a group's workers.

The trainer (data rank 0) hands each piece of a refit to the head of one tree, the one that has
carried fewer bytes so far (``PieceRoutes``); a worker receives each piece from its parent in
that piece's tree and sends it on to its children there. Tree A
is a binary heap over the workers in data-rank order (1..N), tree B the same heap over them in
reverse order (N..1). The workers with children in A (data ranks 1..N//2) are leaves in B, and
those with children in B (the last N//2) are leaves in A. So every worker receives each byte
once and sends at most the refit's bytes and one piece in all (two children, half of the bytes),
as the trainer does: what crosses any one link stays the same however many workers there are, and a
piece reaches the deepest worker in ``depth`` = floor(log2 N) + 1 hops. NCCL builds its double
binary trees the same way for its all-reduce.
"""

from __future__ import annotations

import attrs
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.validate import is_int, positive_int

TREES = 2
TRAINER = 0  # the data rank that sends every piece


@attrs.frozen
class RelayTrees:
    """The two trees over data ranks 1..``workers`` (the trainer is data rank 0)."""

    workers: int = attrs.field(validator=positive_int("workers"))

    @property
    def depth(self) -> int:
        """Hops from the trainer to the deepest worker of either tree."""
        return self.workers.bit_length()

    def parent(self, tree: int, data_rank: int) -> int:
        """Whom ``data_rank`` receives the pieces of ``tree`` from (0: the trainer)."""
        position = self._position(tree, self._check_worker(data_rank))
        return TRAINER if position == 1 else self._rank(tree, position // 2)

    def children(self, tree: int, data_rank: int) -> tuple[int, ...]:
        """Whom ``data_rank`` sends the pieces of ``tree`` on to (the trainer: the tree's head)."""
        if data_rank == TRAINER:
            return (self._rank(self._check_tree(tree), 1),)
        position = self._position(tree, self._check_worker(data_rank))
        return tuple(self._rank(tree, child) for child in (2 * position, 2 * position + 1)
                     if child <= self.workers)

    def _rank(self, tree: int, position: int) -> int:
        """The data rank at heap position ``position`` (1-based) of ``tree``."""
        return position if tree == 0 else self.workers + 1 - position

    def _position(self, tree: int, data_rank: int) -> int:
        return self._rank(self._check_tree(tree), data_rank)  # the mapping is its own inverse

    def _check_worker(self, data_rank: int) -> int:
        if not is_int(data_rank) or not 1 <= data_rank <= self.workers:
            raise InvalidValue("data_rank", data_rank, f"a worker is in [1, {self.workers}]")
        return data_rank

    @staticmethod
    def _check_tree(tree: int) -> int:
        if not is_int(tree) or not 0 <= tree < TREES:
            raise InvalidValue("tree", tree, f"must be in [0, {TREES})")
        return tree


class PieceRoutes:
    """The tree each piece of one refit travels, piece after piece in the refit's order: the
    tree that has carried fewer bytes so far (tree A on a tie), so each carries half of the
    bytes to within one piece. The trainer and every worker walk the same pieces alike."""

    def __init__(self) -> None:
        self._carried = [0] * TREES

    def next_tree(self, nbytes: int) -> int:
        tree = min(range(TREES), key=self._carried.__getitem__)
        self._carried[tree] += nbytes
        return tree
