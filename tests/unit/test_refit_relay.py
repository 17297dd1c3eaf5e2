"""The relay's two trees (core/fanout.py): each reaches every worker from the trainer, no
worker has children in both, the depth is floor(log2 N) + 1, and pieces split evenly by bytes."""

from __future__ import annotations

import pytest

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.fanout import TRAINER, TREES, PieceRoutes, RelayTrees


@pytest.mark.parametrize("workers", [*range(1, 40), 127, 128, 129, 1024])
def test_each_tree_reaches_every_worker_once_and_interiors_are_disjoint(workers):
    trees = RelayTrees(workers)
    interior: list[set[int]] = []
    for tree in range(TREES):
        reached = {TRAINER}
        frontier = [TRAINER]
        hops = 0
        while frontier:
            frontier = [child for rank in frontier for child in trees.children(tree, rank)]
            assert not reached & set(frontier), "a worker is reached twice"
            reached |= set(frontier)
            hops += bool(frontier)
        assert reached == set(range(workers + 1))
        assert hops == trees.depth == workers.bit_length()
        for rank in range(1, workers + 1):
            assert rank in trees.children(tree, trees.parent(tree, rank))
            assert len(trees.children(tree, rank)) <= 2
        interior.append({rank for rank in range(1, workers + 1) if trees.children(tree, rank)})
    assert not interior[0] & interior[1]


def test_a_rank_or_tree_outside_the_group_is_refused():
    trees = RelayTrees(4)
    for call in (lambda: trees.parent(0, 0), lambda: trees.parent(0, 5),
                 lambda: trees.children(2, 1), lambda: trees.children(0, True)):
        with pytest.raises(InvalidValue):
            call()
    with pytest.raises(InvalidValue):
        RelayTrees(0)


def test_pieces_split_between_the_trees_to_within_one_piece():
    routes = PieceRoutes()
    sizes = [4 << 20, 100, 4 << 20, 3 << 20, 7, 4 << 20, 1 << 20]
    carried = [0, 0]
    for size in sizes:
        carried[routes.next_tree(size)] += size
    assert abs(carried[0] - carried[1]) <= max(sizes)
    assert PieceRoutes().next_tree(5) == 0  # a tie: tree A
