"""A replay of NeMo-RL's GRPO call sequence against the drop-in ``DynamoGeneration``.

The order is NeMo-RL's newest (``nemo_rl/algorithms/grpo.py``, the stored version whose loop
starts from ``_initial_policy_generation_stale``: code-search id 67416423259, the index records
no commit for it; the path's one listed commit, ddbdb1e5, is older), backend "dynamo", not
colocated, with NeMo-RL's side played by this project's restatement of what it does
(``tests/support/nemo_rl_contract.py`` and ``nemo_rl_config_checks.py``). Setup: the generation
config is prepared as ``configure_generation_config`` does and passes the checks NeMo-RL
applies, the backend's ``validate_settings`` runs, the backend is built from the inference
cluster by keyword (``cluster=``, ``config=``, ``tokenizer=``, ``tokenizer_config=``), and the
synchroniser NeMo-RL creates is attached as ``weight_synchronizer`` and runs
``init_communicator`` (``prepare_refit_info`` in the mode ``get_refit_payload_mode`` asks, then
``init_collective`` on both sides). The loop reads ``requires_kv_scale_sync``, takes the backend
as stale while its synchroniser is, and each step: refits if stale (``refit_policy_generation``:
the attached synchroniser's ``sync_weights(timer=, kv_scales=)``, no other call) or else
``prepare_for_generation``; ``snapshot_step_metrics``; ``clear_logger_metrics``; generates
through ``generate_async`` with NeMo-RL's batch type and right-padding check on the way in and
out; ``finish_generation``; ``get_logger_metrics``; ``get_step_metrics``; trains (new weights,
now stale); then validates (every step here): refit since stale, greedy ``generate_async``,
``finish_generation``.

On the CPU NeMo-RL has no sender, so the trainer ranks are a Ray actor that sends with the
project's trainer helper in the protocol the drop-in's sender spec names (``nccl_peer``), with
the buffer geometry the synchroniser passes from that spec.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
import torch

from rollout_fleet.adapters.shared import free_port
from rollout_fleet.wiring.nemo_rl import LOGGER_METRICS, DynamoGeneration
from tests.fleet.helpers import assert_nothing_left, fleet_ports, own_children_before
from tests.support.nemo_rl_config_checks import check_dynamo_generation_config
from tests.support.nemo_rl_contract import CollectiveRefit, TensorBatch, require_right_padded


def configure_generation_config(config: dict, *, model: str, pad_token_id: int,
                                eos_token_id: int) -> dict:
    """What NeMo-RL's setup writes into ``policy.generation`` before building the backend."""
    config = {**config, "model_name": model, "_pad_token_id": pad_token_id}
    if config.get("stop_token_ids") is None:
        config["stop_token_ids"] = [eos_token_id]
    config["vllm_cfg"] = {**config["vllm_cfg"], "load_format": "dummy"}  # weights come by refit
    return config


class TrainCluster:
    """The trainer's RayVirtualCluster, as the synchroniser reads it."""

    def get_master_address_and_port(self) -> tuple[str, int]:
        return "127.0.0.1", free_port("127.0.0.1")

    def world_size(self) -> int:
        return 1


class InferenceCluster:
    """NeMo-RL's RayVirtualCluster for inference without GPUs: its placement groups."""

    use_gpus = False

    def __init__(self, groups: Sequence[Any]) -> None:
        self.groups = list(groups)

    def get_placement_groups(self) -> list:
        return self.groups

    def world_size(self) -> int:
        return sum(group.bundle_count for group in self.groups)


@ray.remote(num_cpus=0)
class TrainerRank:
    """The trainer's one rank (NeMo-RL's policy worker), sending with the project's helper."""

    def __init__(self) -> None:
        self.session = None

    def init_collective(self, ip: str, port: int, world_size: int, train_world_size: int,
                        nccl_peer: str) -> bool:
        from rollout_fleet.adapters.collective import TrainerRefitSession
        from rollout_fleet.core.refit import CollectiveSenderSpec

        self.session = TrainerRefitSession(ip, port, 0, world_size, timeout_s=120,
                                           train_world_size=train_world_size,
                                           spec=CollectiveSenderSpec(protocol=nccl_peer))
        return True

    def broadcast(self, weights: Mapping[str, torch.Tensor], protocol: str,
                  buffer_size_bytes: int, num_buffers: int) -> bool:
        from rollout_fleet.adapters.collective.transfer import TorchWeightSender
        from rollout_fleet.core.refit import CollectiveSenderSpec

        spec = CollectiveSenderSpec(protocol=protocol, buffer_bytes=buffer_size_bytes,
                                    num_buffers=num_buffers)
        if self.session.sender.spec != spec:  # NeMo-RL passes the geometry at each broadcast
            self.session.sender = TorchWeightSender(self.session.group, spec)
        self.session.send_state_dict(dict(weights))
        return True


class Policy:
    """NeMo-RL's policy as the synchroniser drives it: futures from its worker group."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = dict(weights)
        self.rank = TrainerRank.remote()
        self.nccl_peer: str | None = None
        self.refit_payload_mode: str | None = None

    def prepare_refit_info(self, refit_payload_mode: str | None = None) -> dict:
        if refit_payload_mode not in (None, "hf_export"):  # the only mode a Hugging Face
            raise ValueError(f"refit_payload_mode {refit_payload_mode!r}")  # trainer exports
        self.refit_payload_mode = refit_payload_mode
        return {name: (tuple(t.shape), t.dtype) for name, t in self.weights.items()}

    def init_collective(self, ip, port, world_size, *, train_world_size, nccl_peer="nemo"):
        self.nccl_peer = nccl_peer
        return [self.rank.init_collective.remote(ip, port, world_size, train_world_size, nccl_peer)]

    def broadcast_weights_for_collective(self, kv_scales=None, *, buffer_size_bytes=None,
                                         num_buffers=None):
        return [self.rank.broadcast.remote(self.weights, self.nccl_peer, buffer_size_bytes,
                                           num_buffers)]

    def train(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = dict(weights)


def right_padded(prompts: Sequence[Sequence[int]], pad: int) -> TensorBatch:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt)
    return TensorBatch({"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts]),
                            "stop_strings": [None] * len(prompts)})


def generate(generation: DynamoGeneration, prompts, pad: int, greedy: bool) -> TensorBatch:
    """As NeMo-RL's async rollouts do: samples as they finish, stacked in sample order."""
    batch = right_padded(prompts, pad)
    require_right_padded(batch, pad)

    async def collect():
        return [pair async for pair in generation.generate_async(batch, greedy=greedy)]

    pairs = sorted(asyncio.run(collect()), key=lambda pair: pair[0])
    assert [index for index, _ in pairs] == list(range(len(prompts)))
    assert all(isinstance(sample, TensorBatch) for _, sample in pairs)  # the caller's type
    out = TensorBatch.join([sample for _, sample in pairs], pad_values={"output_ids": pad})
    require_right_padded(out, pad)
    return out


def replay(config: dict, cluster: InferenceCluster, policy: Policy, *, prompts, pad: int,
           steps: Sequence[Mapping[str, torch.Tensor]],
           check: Callable[[TensorBatch, Mapping[str, torch.Tensor]], None]) -> dict:
    """Run the sequence; ``check(greedy outputs, weights served)`` after each refit. Returns
    what the test asserts on at the end."""
    check_dynamo_generation_config(config)  # NeMo-RL checks the config first
    DynamoGeneration.validate_settings({"policy": {"generation": config}})  # then the backend
    before = own_children_before()
    generation = DynamoGeneration(cluster=cluster, config=config, tokenizer=None,
                                  tokenizer_config=None)
    fleet = generation._fleet
    pgids = fleet.process_groups()
    ports = fleet_ports(fleet)
    try:
        synchronizer = CollectiveRefit(policy, generation, TrainCluster(), cluster)
        generation.weight_synchronizer = synchronizer
        synchronizer.init_communicator()
        assert getattr(generation, "requires_kv_scale_sync", False) is False
        stale = generation.weight_synchronizer is None or synchronizer.is_stale

        def refit_or_wake() -> None:
            nonlocal stale
            if stale:  # refit_policy_generation: the attached synchroniser does all of it
                generation.weight_synchronizer.sync_weights(timer=None, kv_scales=None)
                stale = False
            else:
                generation.prepare_for_generation()

        step_metrics = []
        for weights in steps:
            refit_or_wake()
            generation.snapshot_step_metrics()  # STEP_HOOKS, in NeMo-RL's order
            generation.clear_logger_metrics()
            sampled = generate(generation, prompts, pad, greedy=False)
            assert sampled["output_ids"].shape[0] == len(prompts)
            generation.finish_generation()
            assert set(generation.get_logger_metrics()) == set(LOGGER_METRICS)
            step_metrics.append(generation.get_step_metrics())
            policy.train(weights)
            stale = True
            refit_or_wake()  # validation, every step here
            check(generate(generation, prompts, pad, greedy=True), policy.weights)
            generation.finish_generation()
        outcome = {"metrics": generation.get_logger_metrics(),
                   "spec": generation.get_collective_sender_spec(),
                   "versions": generation.native.get_weight_versions(),
                   "step_metrics": step_metrics, "payload_mode": policy.refit_payload_mode,
                   "bundles": [w.node_id for w in fleet.workers]}
    finally:
        assert generation.shutdown() is True
    assert_nothing_left(pgids, ports, before)
    return outcome
