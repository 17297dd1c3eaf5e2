"""Token staging in TransferQueue (0.1.11), NeMo-RL's data plane: each captured turn is one
sample of the staging partition, keyed ``<rollout_id>/<model_call_id>``, in NeMo-RL's column
layout (``columns.py``), written and read through TransferQueue's key-value calls.

TransferQueue's controller and storage units are Ray actors. A process stages once it is
connected to the Ray cluster where they run: ``attach_transfer_queue`` there (a fleet beside a
NeMo-RL trainer, which started them); ``start_transfer_queue`` starts them itself, as
NeMo-RL's driver does (tests, a run without a trainer's data plane).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_fleet.adapters.transfer_queue.columns import (
    LINK_COLUMNS, STAGING_COLUMNS, identity_at, link_at, row_at, row_columns, row_tags,
)
from rollout_fleet.core.capture_records import (
    StagedRow, StagedRowMissing, StagingChainBroken, StagingUnavailable, join_chain,
)
from rollout_fleet.core.token_capture import TokenStaging

_CONTROLLER = ("TransferQueueController", "transfer_queue")  # the Ray actor's name, namespace


def _tq() -> Any:
    import transfer_queue

    return transfer_queue


def start_transfer_queue(*, storage_units: int = 1, capacity: int | None = None) -> None:
    """Start TransferQueue in this process's Ray cluster, configured as NeMo-RL's driver
    configures it: SimpleStorage over ``storage_units`` units holding up to ``capacity``
    samples (None: no bound), a polling controller. Where one runs already, attach to it."""
    _ray_connected()
    _tq().init({"controller": {"polling_mode": True},
                "backend": {"storage_backend": "SimpleStorage",
                            "SimpleStorage": {"num_data_storage_units": storage_units,
                                              "total_storage_size": capacity}}})


def attach_transfer_queue() -> None:
    """Connect this process to the TransferQueue running in its Ray cluster (never starting
    one): ``StagingUnavailable`` when this process has no Ray, or its cluster no controller."""
    import ray

    _ray_connected()
    try:
        ray.get_actor(_CONTROLLER[0], namespace=_CONTROLLER[1])
    except ValueError:
        raise StagingUnavailable("no TransferQueue controller runs in this Ray cluster: the "
                                 "trainer starts it (or start_transfer_queue)") from None
    _tq().init()


def stop_transfer_queue() -> None:
    """Close this process's TransferQueue client (and what this process started)."""
    _tq().close()


def _ray_connected() -> None:
    import ray

    if not ray.is_initialized():
        raise StagingUnavailable("this process is not connected to a Ray cluster: "
                                 "TransferQueue runs as Ray actors (ray.init first)")


class TransferQueueStaging(TokenStaging):
    """Captured rows in TransferQueue's partition ``partition`` (NeMo-RL's
    ``token_capture.staging_partition``). Its failures are ``StagingUnavailable``."""

    def __init__(self, partition: str) -> None:
        if not isinstance(partition, str) or not partition:
            raise ValueError(f"partition={partition!r}: must be a non-empty partition name")
        self.partition = partition

    def stage(self, row: StagedRow) -> None:
        from tensordict import TensorDict

        key = row.staging_key
        fields = TensorDict(row_columns(row), batch_size=[1])
        try:
            _tq().kv_batch_put(keys=[key], partition_id=self.partition, fields=fields,
                               tags=[row_tags(row)])
        except Exception as error:
            # A put that fails part way can leave some columns stored: drop them, so the key
            # never reads as a row (its coordinates say capture_failed, so nothing asks).
            self._discard(key)
            raise StagingUnavailable(f"TransferQueue did not store {key!r} in "
                                     f"{self.partition!r}: {type(error).__name__}: {error}"
                                     ) from error

    def _discard(self, key: str) -> None:
        try:
            _tq().kv_clear(keys=[key], partition_id=self.partition)
        except Exception:  # the stage's own failure is the one to report
            pass

    def rows(self, keys: Sequence[str]) -> list[StagedRow]:
        batch = self._read(keys, STAGING_COLUMNS, "staging key")
        rows = []
        for index, key in enumerate(keys):
            try:
                row = row_at(batch, index)
                row.verify()
            except ValueError as error:  # InvalidValue included: a row not as it was staged
                raise StagingChainBroken("staging key", key,
                                         f"its row cannot be read back: {error}") from error
            if row.staging_key != key:
                raise StagingChainBroken("staging key", key,
                                         f"the row read is {row.staging_key!r}'s")
            rows.append(row)
        return rows

    def prefix(self, staging_chain: Sequence[str], *,
               parent_chain_hash: str | None = None) -> list[int]:
        batch = self._read(staging_chain, LINK_COLUMNS, "staging_chain")
        links = []
        for index, key in enumerate(staging_chain):
            try:
                links.append(link_at(batch, index))
            except ValueError as error:
                raise StagingChainBroken(f"staging_chain[{index}]", key,
                                         f"its row cannot be read back: {error}") from error
        return join_chain(staging_chain, links, parent_chain_hash)

    def clear(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        try:
            _tq().kv_clear(keys=list(keys), partition_id=self.partition)
        except Exception as error:
            raise StagingUnavailable(f"TransferQueue did not clear {len(keys)} keys of "
                                     f"{self.partition!r}: {type(error).__name__}: {error}"
                                     ) from error

    def _read(self, keys: Sequence[str], columns: Sequence[str], what: str) -> Any:
        """The samples under ``keys``, in order, one per key; a key without a (whole) row is
        named by ``StagedRowMissing``."""
        if not keys:
            from tensordict import TensorDict

            return TensorDict({}, batch_size=[0])
        if len(set(keys)) != len(keys):
            raise StagingChainBroken(what, list(keys), "names a row twice")
        try:
            batch = _tq().kv_batch_get(keys=list(keys), partition_id=self.partition,
                                       select_fields=list(columns))
        except ValueError as error:
            if "not found" not in str(error):
                raise StagingUnavailable(f"TransferQueue could not read {self.partition!r}: "
                                         f"{error}") from error
            batch = None  # no key has a row
        except Exception as error:
            raise StagingUnavailable(f"TransferQueue could not read {self.partition!r}: "
                                     f"{type(error).__name__}: {error}") from error
        found = int(batch.batch_size[0]) if batch is not None and batch.batch_size else 0
        whole = batch is not None and set(columns) <= set(batch.keys())
        if found == len(keys) and whole:
            return batch
        # TransferQueue leaves out keys it does not hold, and columns that some key lacks.
        held = {identity_at(batch, index) for index in range(found)} if whole else set()
        index, key = next(((i, k) for i, k in enumerate(keys) if k not in held), (0, keys[0]))
        raise StagedRowMissing(f"{what}[{index}]" if what == "staging_chain" else what, key,
                               f"no whole row is staged under it in {self.partition!r}")
