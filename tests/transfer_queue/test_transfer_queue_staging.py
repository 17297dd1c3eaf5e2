"""TransferQueue's token staging against a real TransferQueue 0.1.11 (SimpleStorage, one
storage unit) on a local Ray: it passes the token-staging contract, and what it writes is
NeMo-RL's staging-partition row, read back as NeMo-RL's finalizer reads it."""

from __future__ import annotations

import uuid

import pytest

from rollout_fleet.adapters.transfer_queue import (
    TransferQueueStaging, start_transfer_queue, stop_transfer_queue,
)
from rollout_fleet.adapters.transfer_queue.columns import STAGING_COLUMNS
from rollout_fleet.core.capture_digest import row_digest
from rollout_fleet.core.capture_records import StagedRowMissing
from rollout_fleet.ports.contracts.token_staging import TokenStagingContract, trajectory

pytestmark = pytest.mark.ray

# NeMo-RL's token-capture staging columns (data_plane/tq_token_sink.py, STAGING_FIELDS).
NEMO_RL_STAGING_FIELDS = {
    "token_ids_delta", "token_mask_delta", "generation_logprobs_delta",
    "compact_token_ids_delta", "compact_len", "schema_version", "digest_version",
    "extras_digest_version", "rollout_id_utf8", "model_call_id_utf8", "parent_call_id_utf8",
    "parent_call_id_present", "capture_mode", "prev_len", "delta_len", "cum_len",
    "weight_version", "digest_bytes", "extras_digest_bytes", "chain_hash_bytes",
    "chain_hash_present", "cumulative_hash_bytes", "cumulative_hash_present",
    "extras_metadata_json", "routed_experts_encoding", "routed_len",
}


@pytest.fixture(scope="module")
def transfer_queue():
    import ray
    import transfer_queue as tq

    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        start_transfer_queue(storage_units=1)
        yield tq
        stop_transfer_queue()
    finally:
        ray.shutdown()


@pytest.fixture
def staging_under_test(transfer_queue):
    staging = TransferQueueStaging(f"staging-{uuid.uuid4().hex[:8]}")
    yield staging
    held = transfer_queue.kv_list(staging.partition).get(staging.partition, {})
    staging.clear(list(held))


class TestTransferQueueStaging(TokenStagingContract):
    pass


def test_a_row_is_nemo_rls_staging_row(staging_under_test, transfer_queue):
    import torch

    root, row = trajectory(turns=2)
    staging_under_test.stage(root)
    staging_under_test.stage(row)
    batch = transfer_queue.kv_batch_get(keys=[row.staging_key],
                                        partition_id=staging_under_test.partition)
    assert set(batch.keys()) == NEMO_RL_STAGING_FIELDS == set(STAGING_COLUMNS)

    def column(name):
        return batch.get(name)[0].reshape(-1)

    def raw(name):
        return bytes(column(name).tolist())

    dtypes = {"token_ids_delta": torch.int64, "token_mask_delta": torch.float32,
              "generation_logprobs_delta": torch.float32, "rollout_id_utf8": torch.uint8,
              "digest_bytes": torch.uint8, "parent_call_id_present": torch.bool,
              "chain_hash_present": torch.bool, "capture_mode": torch.int64,
              "weight_version": torch.int64}
    assert {name: column(name).dtype for name in dtypes} == dtypes
    assert (raw("rollout_id_utf8"), raw("model_call_id_utf8"), raw("parent_call_id_utf8")) == (
        b"rollout-1", b"call-1", b"call-0")
    assert [column(name).item() for name in ("capture_mode", "prev_len", "delta_len",
                                             "cum_len", "weight_version", "schema_version",
                                             "routed_len", "compact_len")] == [
        1, row.prev_len, row.delta_len, row.cum_len, 1, 2, 0, 0]
    assert raw("extras_metadata_json") == b"null"
    fetched_logprobs = column("generation_logprobs_delta").tolist()
    # The digest recomputed over the values read back is the one staged (float32 bit exact).
    recomputed = row_digest(
        rollout_id="rollout-1", model_call_id="call-1", parent_call_id="call-0",
        mode="token_in", lengths=(row.prev_len, row.delta_len, row.cum_len), weight_version=1,
        token_ids_delta=column("token_ids_delta").tolist(),
        token_mask_delta=column("token_mask_delta").tolist(),
        generation_logprobs_delta=fetched_logprobs,
        extras_digest=raw("extras_digest_bytes").hex(), chain_hash=raw("chain_hash_bytes").hex(),
        cumulative_hash=raw("cumulative_hash_bytes").hex())
    assert recomputed == raw("digest_bytes").hex() == row.digest
    tags = transfer_queue.kv_list(staging_under_test.partition)[staging_under_test.partition]
    assert tags[row.staging_key]["digest"] == row.digest


def test_a_key_holding_only_part_of_a_row_reads_as_missing(staging_under_test, transfer_queue):
    import torch
    from tensordict import TensorDict

    (root,) = trajectory(turns=1)
    transfer_queue.kv_batch_put(
        keys=[root.staging_key], partition_id=staging_under_test.partition,
        fields=TensorDict({"token_ids_delta": torch.tensor([[1, 2]])}, batch_size=[1]),
        tags=[{}])
    with pytest.raises(StagedRowMissing) as missing:
        staging_under_test.prefix([root.staging_key])
    assert missing.value.field == "staging_chain[0]"
    staging_under_test.stage(root)  # a whole row under the key reads again
    assert staging_under_test.rows([root.staging_key]) == [root]
