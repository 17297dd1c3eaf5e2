"""Token staging in this process's memory: the same port as TransferQueue's, for tests and
for a fleet that runs without a trainer's data plane (nothing outlives the process)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from rollout_fleet.core.capture_records import (
    ChainLink, StagedRow, StagedRowMissing, StagingChainBroken, join_chain,
)
from rollout_fleet.core.token_capture import TokenStaging


class InMemoryStaging(TokenStaging):
    """Rows in a dict keyed by staging key, behind a lock (several threads stage at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, StagedRow] = {}

    def stage(self, row: StagedRow) -> None:
        with self._lock:
            self._rows[row.staging_key] = row

    def rows(self, keys: Sequence[str]) -> list[StagedRow]:
        if len(set(keys)) != len(keys):
            raise StagingChainBroken("staging key", list(keys), "names a row twice")
        with self._lock:
            for key in keys:
                if key not in self._rows:
                    raise StagedRowMissing("staging key", key, "no row is staged under it")
            return [self._rows[key] for key in keys]

    def prefix(self, staging_chain: Sequence[str], *,
               parent_chain_hash: str | None = None) -> list[int]:
        links: list[ChainLink] = []
        with self._lock:
            for index, key in enumerate(staging_chain):
                row = self._rows.get(key)
                if row is None:
                    raise StagedRowMissing(f"staging_chain[{index}]", key,
                                           "no row is staged under it")
                links.append(row.link())
        return join_chain(staging_chain, links, parent_chain_hash)

    def clear(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._rows.pop(key, None)

    def keys(self) -> list[str]:
        """The staging keys held now."""
        with self._lock:
            return list(self._rows)
