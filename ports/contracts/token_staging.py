"""The token-staging port's contract suite (``core.token_capture.TokenStaging``).

Usage: a class deriving from ``TokenStagingContract`` with a ``staging_under_test`` fixture
that yields a fresh, empty store (its own partition) and cleans up after::

    class TestMyStaging(TokenStagingContract):
        @pytest.fixture
        def staging_under_test(self):
            yield MyStaging(...)
"""

from __future__ import annotations

import threading

import attrs
import pytest

from rollout_fleet.core.capture_admission import CaptureAdmission
from rollout_fleet.core.capture_digest import chain_hash
from rollout_fleet.core.capture_records import (
    StagedRow, StagedRowMissing, StagingChainBroken, build_row,
)
from rollout_fleet.core.token_capture import TokenStaging


def trajectory(rollout_id: str = "rollout-1", turns: int = 3) -> list[StagedRow]:
    """The rows of an agent's trajectory of ``turns`` calls, each continuing the one before
    (logprobs that float32 does not hold exactly, token IDs past 2**16)."""
    rows: list[StagedRow] = []
    tokens: list[int] = []
    for turn in range(turns):
        prompt = tokens + [70_000 + turn, 11, 12 + turn]
        generated = [300 + turn, 301, 302 + turn]
        parent = rows[-1] if rows else None
        admission = CaptureAdmission(
            rollout_id, f"call-{turn}", "token_in" if parent else "text",
            parent_call_id=parent.model_call_id if parent else None, prev_len=len(tokens),
            required_prefix_token_ids=tuple(tokens),
            parent_chain_hash=parent.chain_hash if parent else None)
        rows.append(build_row(admission, tokens, turn, prompt, generated,
                              [-0.1 * (i + 1) - turn for i in range(len(generated))]))
        tokens = prompt + generated
    return rows


def all_tokens(rows: list[StagedRow]) -> list[int]:
    return [token for row in rows for token in row.token_ids_delta]


class TokenStagingContract:
    def _stage(self, staging: TokenStaging, rows: list[StagedRow]) -> list[str]:
        for row in rows:
            staging.stage(row)
        return [row.staging_key for row in rows]

    def test_a_staged_row_reads_back_exactly(
            self, staging_under_test: TokenStaging) -> None:
        rows = trajectory()
        keys = self._stage(staging_under_test, rows)
        assert staging_under_test.rows(keys) == rows
        for row in staging_under_test.rows(keys[::-1]):
            row.verify()  # its digest is the one of what was read
        assert staging_under_test.rows([]) == []

    def test_the_prefix_of_a_chain_is_its_deltas_root_first(
            self, staging_under_test: TokenStaging) -> None:
        rows = trajectory()
        keys = self._stage(staging_under_test, rows)
        assert staging_under_test.prefix(keys[:1]) == list(rows[0].token_ids_delta)
        assert staging_under_test.prefix(keys[:2]) == all_tokens(rows[:2])
        whole = staging_under_test.prefix(keys, parent_chain_hash=rows[-1].chain_hash)
        assert whole == all_tokens(rows) and len(whole) == rows[-1].cum_len
        assert staging_under_test.prefix([]) == []

    def test_a_missing_row_is_named_with_its_place(
            self, staging_under_test: TokenStaging) -> None:
        keys = self._stage(staging_under_test, trajectory())
        with pytest.raises(StagedRowMissing) as missing:
            staging_under_test.prefix([keys[0], "rollout-1/never"])
        assert (missing.value.field, missing.value.value) == ("staging_chain[1]",
                                                              "rollout-1/never")
        with pytest.raises(StagedRowMissing) as unknown:
            staging_under_test.rows([keys[1], "rollout-9/call-0"])
        assert unknown.value.value == "rollout-9/call-0"

    def test_a_chain_that_does_not_link_is_refused_where_it_breaks(
            self, staging_under_test: TokenStaging) -> None:
        keys = self._stage(staging_under_test, trajectory())
        other = self._stage(staging_under_test, trajectory("rollout-2"))
        for chain, place in (([keys[0], keys[2]], 1),  # a row skipped
                             (keys[1:], 0),  # not from the root
                             ([keys[0], other[1]], 1),  # another trajectory's row
                             ([keys[1], keys[0]], 0)):  # out of order
            with pytest.raises(StagingChainBroken) as broken:
                staging_under_test.prefix(chain)
            assert not isinstance(broken.value, StagedRowMissing)
            assert broken.value.field == f"staging_chain[{place}]", chain
            assert broken.value.value == chain[place]
        with pytest.raises(StagingChainBroken, match="twice"):
            staging_under_test.prefix([keys[0], keys[0]])

    def test_the_chain_must_end_at_the_parent_chain_hash(
            self, staging_under_test: TokenStaging) -> None:
        rows = trajectory()
        keys = self._stage(staging_under_test, rows)
        with pytest.raises(StagingChainBroken, match="parent_chain_hash"):
            staging_under_test.prefix(keys[:2], parent_chain_hash=rows[2].chain_hash)

    def test_a_row_whose_tokens_do_not_give_its_chain_hash_is_refused(
            self, staging_under_test: TokenStaging) -> None:
        root, child = trajectory(turns=2)
        wrong = chain_hash(None, [1, 2, 3])
        forged = attrs.evolve(child, chain_hash=chain_hash(wrong, child.token_ids_delta))
        forged = attrs.evolve(forged, digest=forged.expected_digest())
        keys = self._stage(staging_under_test, [root, forged])
        with pytest.raises(StagingChainBroken, match="chain hash") as broken:
            staging_under_test.prefix(keys)
        assert broken.value.field == "staging_chain[1]"

    def test_staging_a_key_again_replaces_its_row(
            self, staging_under_test: TokenStaging) -> None:
        root = trajectory(turns=1)[0]
        again = build_row(CaptureAdmission(root.rollout_id, root.model_call_id, "text"), (), 9,
                          [5, 6], [7], [-0.5])
        self._stage(staging_under_test, [root, again])
        assert staging_under_test.rows([root.staging_key]) == [again]

    def test_clear_drops_rows_and_ignores_keys_without_one(
            self, staging_under_test: TokenStaging) -> None:
        keys = self._stage(staging_under_test, trajectory())
        staging_under_test.clear([keys[0], "rollout-1/never"])
        staging_under_test.clear([])
        with pytest.raises(StagedRowMissing):
            staging_under_test.rows(keys[:1])
        assert [row.staging_key for row in staging_under_test.rows(keys[1:])] == keys[1:]
        staging_under_test.clear(keys[1:])
        with pytest.raises(StagedRowMissing):
            staging_under_test.prefix(keys)

    def test_rows_staged_from_several_threads_all_land(
            self, staging_under_test: TokenStaging) -> None:
        trajectories = [trajectory(f"rollout-{n}", turns=2) for n in range(6)]
        errors: list[BaseException] = []

        def stage(rows: list[StagedRow]) -> None:
            try:
                self._stage(staging_under_test, rows)
            except BaseException as error:  # reported by the assertion below
                errors.append(error)

        threads = [threading.Thread(target=stage, args=(rows,)) for rows in trajectories]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert errors == []
        for rows in trajectories:
            keys = [row.staging_key for row in rows]
            assert staging_under_test.prefix(keys) == all_tokens(rows)
