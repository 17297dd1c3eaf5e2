"""NeMo-RL's DynamoGeneration, swapped in: built from a NeMo-RL-style config dict, it starts and
owns a fleet (memory-engine workers on real Ray behind the real Dynamo frontend), answers in
NeMo-RL's shapes, keys and dtypes, refits, and leaves nothing behind after shutdown()."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray
import torch

from rollout_fleet.adapters.collective import TrainerRefitSession
from rollout_fleet.adapters.memory.engine import MemoryEngine, TinyBigramModel
from rollout_fleet.adapters.memory.model_folder import write_model_folder
from rollout_fleet.adapters.shared import free_port
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.rollout import GREEDY
from rollout_fleet.wiring.nemo_rl import DynamoGeneration, read_nemo_rl_config
from tests.driver.conftest import PAD, collect, mixed_batch
from tests.fleet.helpers import assert_nothing_left, fleet_ports, own_children_before

pytestmark = pytest.mark.ray
MAX_MODEL_LEN, MAX_NEW, WORKERS = 128, 10, 2
STOP_TOKEN = 5
NEMO_RL_KEYS = ("inflight_batch_sizes", "num_pending_samples", "kv_cache_usage_perc",
                "generation_tokens")


def nemo_rl_config(model_folder, **overrides) -> dict:
    """``policy.generation`` as NeMo-RL's Dynamo recipes write it, plus the fleet's own section."""
    config = {
        "backend": "dynamo", "model_name": str(model_folder), "max_new_tokens": MAX_NEW,
        "temperature": 0.0, "top_p": 1.0, "top_k": None, "stop_strings": None,
        "stop_token_ids": [STOP_TOKEN], "_pad_token_id": PAD,
        "dynamo_cfg": {
            "engine": "vllm", "startup_timeout_s": 120, "request_timeout_s": 60,
            "control_timeout_s": 60, "metrics_include_prefixes": None,
            "metrics_exclude_prefixes": None,
            "worker_args": {"tool_call_parser": None, "reasoning_parser": None,
                            "custom_jinja_template": None, "endpoint_types": ["chat", "completions"]},
            "frontend_args": {"router_mode": "round-robin"},
        },
        "vllm_cfg": {
            "async_engine": True, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "expert_parallel_size": 1, "precision": "float32", "gpu_memory_utilization": 0.6,
            "max_model_len": MAX_MODEL_LEN, "kv_cache_dtype": "auto", "enforce_eager": True,
            "expose_http_server": False, "enable_vllm_metrics_logger": True,
            "vllm_metrics_logger_interval": 0.2, "env_vars": None,
        },
        "vllm_kwargs": {},
        "colocated": {"enabled": False},
        # What NeMo-RL has no key for: this test's engine kind and worker count.
        "rollout_fleet": {"engine": {"kind": "memory", "seed": 0, "context_length": MAX_MODEL_LEN},
                          "num_workers": WORKERS},
    }
    return config | overrides


@pytest.fixture(scope="module")
def dropin(tmp_path_factory):
    before = own_children_before()
    folder = write_model_folder(tmp_path_factory.mktemp("nemo-rl-model") / "model",
                                context_length=MAX_MODEL_LEN)
    generation = DynamoGeneration(None, nemo_rl_config(folder))
    fleet = generation._fleet
    pgids = [w.pid for w in fleet.workers] + [fleet.frontend.process.pid]
    ports = fleet_ports(fleet)
    try:
        yield generation
    finally:
        assert generation.shutdown() is True
        assert generation.shutdown() is True  # safe to repeat
        assert_nothing_left(pgids, ports, before)


def own_answers(prompts, weights=None):
    """The memory engine's greedy answers with the config's budget and stop token."""
    async def answers():
        engine = MemoryEngine(seed=0, context_length=MAX_MODEL_LEN)
        if weights is not None:  # the refit's float32 values, as the workers hold them
            engine.model = TinyBigramModel(weights["embed.weight"].tolist(),
                                           weights["lm_head.weight"].tolist())
        return [await engine.serve_rollout(
            p, request_id=f"own-{i}", sampling=GREEDY, stop_token_ids=[STOP_TOKEN],
            max_new_tokens=min(MAX_NEW, MAX_MODEL_LEN - len(p))) for i, p in enumerate(prompts)]
    return asyncio.run(answers())


def test_the_config_dict_becomes_the_fleets_config(tmp_path):
    settings = read_nemo_rl_config(nemo_rl_config(tmp_path), cluster=None)
    fleet = settings.fleet
    assert (fleet.model, fleet.served_model_name) == (str(tmp_path), str(tmp_path))
    assert (fleet.max_model_len, fleet.max_new_tokens, fleet.num_workers) == (MAX_MODEL_LEN, MAX_NEW, 2)
    assert (fleet.timeouts.start_s, fleet.timeouts.request_s, fleet.timeouts.refit_s) == (120, 60, 60)
    assert fleet.router == "round-robin"
    generation = settings.generation
    assert generation["temperature"] == 0.0 and generation["top_k"] == -1
    assert generation["stop_token_ids"] == (STOP_TOKEN,) and generation["metrics_interval_s"] == 0.2
    assert settings.pad_token_id == PAD


class Cluster:
    """The one thing read from NeMo-RL's RayVirtualCluster: its world size."""

    def __init__(self, size):
        self.size = size

    def world_size(self):
        return self.size


def test_workers_follow_the_clusters_world_size(tmp_path):
    config = nemo_rl_config(tmp_path)
    config["rollout_fleet"] = {"engine": config["rollout_fleet"]["engine"] | {"refit_ranks": 2}}
    config["vllm_cfg"] = config["vllm_cfg"] | {"tensor_parallel_size": 2}
    assert read_nemo_rl_config(config, Cluster(8)).fleet.num_workers == 4
    with pytest.raises(InvalidValue, match=r"cluster.world_size\(\)=3"):
        read_nemo_rl_config(config, Cluster(3))


@pytest.mark.parametrize("change, field", [
    ({"backend": "vllm"}, "policy.generation.backend"),
    ({"vllm_cfg": {"expose_http_server": "yes"}}, "policy.generation.vllm_cfg.expose_http_server"),
    ({"colocated": {"enabled": "yes"}}, "policy.generation.colocated.enabled"),
    ({"dynamo_cfg": {"worker_args": {"tool_call_parser": "hermess"}}},  # not Dynamo's
     "policy.generation.dynamo_cfg.worker_args.tool_call_parser"),
], ids=["backend", "http_server", "colocated", "tool_parser"])
def test_what_this_backend_cannot_do_is_refused_by_name(tmp_path, change, field):
    config = nemo_rl_config(tmp_path)
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    with pytest.raises(InvalidValue) as caught:
        read_nemo_rl_config(config)
    assert str(caught.value).startswith(field)


def test_outputs_have_nemo_rl_keys_dtypes_and_shapes(dropin):
    prompts, data = mixed_batch(12, seed=5)
    data = {"input_ids": data["input_ids"].to(torch.int32), "input_lengths": data["input_lengths"]}
    pairs = asyncio.run(collect(dropin, data, greedy=False))  # temperature 0: greedy anyway
    answers = own_answers(prompts)
    assert sorted(index for index, _ in pairs) == list(range(12))
    for index, sample in pairs:
        prompt, answer = prompts[index], answers[index]
        total = len(prompt) + len(answer.token_ids)
        assert set(sample) == {"output_ids", "logprobs", "generation_lengths",
                               "unpadded_sequence_lengths", "truncated", "weight_versions"}
        assert sample["output_ids"].dtype == torch.int32  # the input's dtype
        assert sample["output_ids"].shape == (1, total)
        assert sample["output_ids"][0].tolist() == prompt + list(answer.token_ids)
        assert sample["logprobs"].dtype == torch.float32 and sample["logprobs"].shape == (1, total)
        assert sample["logprobs"][0, :len(prompt)].eq(0).all()
        assert sample["logprobs"][0, len(prompt):].tolist() == pytest.approx(list(answer.logprobs), abs=1e-6)
        assert sample["generation_lengths"].dtype == torch.long
        assert sample["generation_lengths"].tolist() == [len(answer.token_ids)]
        assert sample["unpadded_sequence_lengths"].dtype == torch.long
        assert sample["unpadded_sequence_lengths"].tolist() == [total]
        assert sample["truncated"].dtype == torch.bool
        assert sample["truncated"].tolist() == [answer.finish_reason.value == "length"]
        assert all(t.device == data["input_ids"].device for t in sample.values())
        generated = list(answer.token_ids)
        assert STOP_TOKEN not in generated[:-1]  # stop_token_ids end a rollout at the token
    assert any(list(answers[i].token_ids)[-1:] == [STOP_TOKEN] for i in range(12)), \
        "no prompt reached the stop token: the stop_token_ids check saw nothing"


def test_an_empty_batch_yields_nothing(dropin):
    empty = {"input_ids": torch.zeros((0, 4), dtype=torch.long),
             "input_lengths": torch.zeros((0,), dtype=torch.long)}
    assert asyncio.run(collect(dropin, empty)) == []


def test_left_padding_and_multimodal_prompts_are_refused(dropin):
    bad = {"input_ids": torch.tensor([[3, 4, PAD], [PAD, 6, 7]]), "input_lengths": torch.tensor([2, 2])}
    with pytest.raises(InvalidValue, match=rf"input_ids\[1\].*right-padded with _pad_token_id={PAD}"):
        asyncio.run(collect(dropin, bad))
    multimodal = {"input_ids": torch.tensor([[3, 4]]), "input_lengths": torch.tensor([2]),
                  "vllm_content": [None]}
    with pytest.raises(InvalidValue, match="vllm_content"):
        asyncio.run(collect(dropin, multimodal))


def test_facts_sender_spec_and_frontend_url(dropin):
    assert dropin.get_inference_world_size() == WORKERS
    spec = dropin.get_collective_sender_spec()
    assert (spec.nccl_peer, spec.buffer_size_bytes, spec.num_buffers) == (
        dropin.native.config.sender_spec.protocol, 1 << 30, 2)
    assert dropin.frontend_url.endswith("/v1")
    listed = httpx.get(f"{dropin.frontend_url}/models", timeout=10).json()
    assert [m["id"] for m in listed["data"]] == [dropin.cfg["model_name"]]
    door = getattr(dropin._fleet, "door", None)  # the fleet's one URL names NeMo-Gym's server
    assert dropin.dp_openai_server_base_urls == [f"{door.url}/v1" if door else None]
    assert dropin.requires_kv_scale_sync is False and dropin.blocks_training() is False
    assert dropin.wake_carries_weight_updates() is False
    assert dropin.prepare_for_generation() is True
    with pytest.raises(NotImplementedError):
        dropin.generate({"input_ids": torch.tensor([[3]]), "input_lengths": torch.tensor([1])})


def test_logger_metrics_have_nemo_rl_keys_and_shapes(dropin):
    asyncio.run(collect(dropin, mixed_batch(8, seed=9)[1]))
    deadline = time.monotonic() + 30  # sampled every 0.2 s since the start
    while time.monotonic() < deadline:
        metrics = dropin.get_logger_metrics()
        counts = metrics["generation_tokens"]
        # Until a sample taken after the rollouts counts their tokens: samples from before
        # them (two per worker already, on a loaded host) all say 0.
        if all(len(counts.get(w, [])) >= 2 for w in range(WORKERS)) and \
                max(v for values in counts.values() for v in values) > 0:
            break
        time.sleep(0.2)
    assert set(metrics) == set(NEMO_RL_KEYS)
    for key in NEMO_RL_KEYS:
        assert set(metrics[key]) == set(range(WORKERS)), (key, metrics[key])
        for values in metrics[key].values():
            assert values and all(isinstance(v, float) for v in values), (key, values)
    assert max(v for values in metrics["generation_tokens"].values() for v in values) > 0, \
        dropin.native.get_logger_metrics()["generated_tokens"]  # with each sample's time
    dropin.clear_logger_metrics()  # starts over (the sampler may add a point at once)
    after = dropin.get_logger_metrics()
    assert all(len(values) <= 1 for per in after.values() for values in per.values()), after


def test_refit_through_the_nemo_rl_methods(dropin):
    prompts, data = mixed_batch(6, seed=11)
    new_weights = {name: torch.tensor(matrix, dtype=torch.float32)
                   for name, matrix in TinyBigramModel.from_seed(7).state_dict().items()}
    port = free_port()
    world_size = 1 + dropin.get_inference_world_size()
    joining = dropin.init_collective("127.0.0.1", port, world_size, train_world_size=1)
    with TrainerRefitSession("127.0.0.1", port, 0, world_size, timeout_s=60,
                             spec=dropin.native.get_collective_sender_spec()) as trainer:
        ray.get(joining, timeout=60)  # Ray runs in this driver: the futures are ObjectRefs
        assert dropin.prepare_refit_info(
            {n: (tuple(t.shape), "float32") for n, t in new_weights.items()}) is None
        info = dropin.refit_info
        updates = dropin.update_weights_from_collective()
        trainer.send_state_dict(new_weights, info)
        ray.get(updates, timeout=60)
    assert set(dropin.native.get_weight_versions().values()) == {1}
    assert dropin.finish_generation() is True  # invalidates every cache
    pairs = dict(asyncio.run(collect(dropin, data)))
    answers = own_answers(prompts, weights=new_weights)
    for index, prompt in enumerate(prompts):
        assert pairs[index]["output_ids"][0].tolist() == prompt + list(answers[index].token_ids)


def test_a_pickled_copy_generates_and_its_shutdown_leaves_the_fleet_running(dropin):
    import pickle

    _prompts, data = mixed_batch(3, seed=13)
    owners = {i: s["output_ids"][0].tolist() for i, s in asyncio.run(collect(dropin, data))}
    copy = pickle.loads(pickle.dumps(dropin))
    try:
        copies = {i: s["output_ids"][0].tolist() for i, s in asyncio.run(collect(copy, data))}
        assert copies == owners  # greedy, the same fleet: the same answers
    finally:
        assert copy.shutdown() is True
    assert len(asyncio.run(collect(dropin, data))) == 3  # the owner's fleet still serves


def test_logger_metrics_after_a_worker_is_lost_keep_every_ordinal(dropin):
    """Last in this module: it leaves one worker out of the drop-in for good."""
    asyncio.run(collect(dropin, mixed_batch(4, seed=17)[1]))
    dropin.native.sample_worker_metrics()
    before = dropin.get_logger_metrics()
    lost = dropin.native.worker_ids[1]
    assert dropin.native.forget_workers([lost]) == (lost,)  # as when the fleet reports it lost
    # The periodic sampler may have added a point to both workers since ``before``; once the
    # worker is left out, none (not even from a sample in flight at that moment).
    when_left_out = dropin.get_logger_metrics()
    dropin.native.sample_worker_metrics()
    after = dropin.get_logger_metrics()
    for key in NEMO_RL_KEYS:
        assert set(after[key]) == set(before[key]) == {0, 1}, (key, after[key])
        # the lost worker's samples stay under its own ordinal; the survivor's grow
        assert when_left_out[key][1][:len(before[key][1])] == before[key][1]
        assert after[key][1] == when_left_out[key][1]
        assert len(after[key][0]) > len(when_left_out[key][0])
