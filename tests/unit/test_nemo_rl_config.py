"""NeMo-RL's ``policy.generation`` keys, as the drop-in reads them (pure: nothing starts): each
vLLM option passed on or refused by name, hub ids found in the local Hugging Face cache, every
router mode Dynamo's frontend takes, a seed per worker, the refit protocol NeMo-RL sends."""

from __future__ import annotations

import pytest

from rollout_fleet.adapters.memory.model_folder import write_model_folder
from rollout_fleet.adapters.tiny_model import build_tiny_model
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import RefitProtocol
from rollout_fleet.wiring.config import ROUTER_MODES, ConfigError, parse_config
from rollout_fleet.wiring.fleet import Fleet
from rollout_fleet.wiring.nemo_rl import read_nemo_rl_config

HUB_ID = "Qwen/Qwen2.5-1.5B"


def generation_config(model, **vllm_cfg) -> dict:
    """A ``policy.generation`` of NeMo-RL's Dynamo recipes (memory-engine free: vLLM keys)."""
    return {
        "backend": "dynamo", "model_name": str(model), "max_new_tokens": 8, "temperature": 1.0,
        "top_p": 1.0, "top_k": None, "stop_strings": None, "stop_token_ids": None,
        "_pad_token_id": 0,
        "dynamo_cfg": {"engine": "vllm", "startup_timeout_s": 60, "request_timeout_s": 60,
                       "control_timeout_s": 60, "worker_args": {},
                       "frontend_args": {"router_mode": "round-robin"}},
        "vllm_cfg": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                     "precision": "float32", "max_model_len": 256, "enforce_eager": True,
                     **vllm_cfg},
        "vllm_kwargs": {},
    }


class GpuCluster:
    def __init__(self, size: int) -> None:
        self.size = size

    def world_size(self) -> int:
        return self.size


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def engine_of(config, cluster=None) -> dict:
    return dict(read_nemo_rl_config(config, cluster).fleet.engine)


def test_pipeline_and_expert_parallel_reach_vllm(tiny):
    engine = engine_of(generation_config(tiny, tensor_parallel_size=2, pipeline_parallel_size=2,
                                         expert_parallel_size=2), GpuCluster(8))
    assert (engine["tensor_parallel_size"], engine["pipeline_parallel_size"]) == (2, 2)
    assert engine["extra_engine_args"]["enable_expert_parallel"] is True
    settings = read_nemo_rl_config(generation_config(tiny, tensor_parallel_size=2,
                                                     pipeline_parallel_size=2), GpuCluster(8))
    assert (settings.fleet.ranks_per_worker, settings.fleet.num_workers) == (4, 2)
    with pytest.raises(InvalidValue) as caught:
        engine_of(generation_config(tiny, tensor_parallel_size=2, expert_parallel_size=4),
                  GpuCluster(8))
    assert str(caught.value).startswith("policy.generation.vllm_cfg.expert_parallel_size")


def test_env_vars_load_format_and_logprobs_mode_are_passed_on(tiny):
    config = generation_config(tiny, env_vars={"NCCL_MNNVL_ENABLE": "0"}, load_format="dummy",
                               kv_cache_dtype="auto", logprobs_mode="processed_logprobs")
    settings = read_nemo_rl_config(config)
    assert settings.fleet.env == {"NCCL_MNNVL_ENABLE": "0"}  # every worker's environment
    extra = settings.fleet.engine["extra_engine_args"]
    assert extra["load_format"] == "dummy" and extra["kv_cache_dtype"] == "auto"
    assert extra["logprobs_mode"] == "processed_logprobs"
    # unset, logprobs are processed ones too (temperature, top-p and top-k applied), as upstream
    plain = engine_of(generation_config(tiny))
    assert plain["extra_engine_args"]["logprobs_mode"] == "processed_logprobs"


@pytest.mark.parametrize("key, value", [
    ("logprobs_mode", "raw_logprobs"), ("use_deep_gemm", True), ("env_vars", {"A": 1}),
    ("speculative_model", "draft"), ("num_last_layers_in_bf16", 2),
])
def test_what_cannot_be_passed_on_is_refused_by_name(tiny, key, value):
    with pytest.raises(InvalidValue) as caught:
        read_nemo_rl_config(generation_config(tiny, **{key: value}))
    assert str(caught.value).startswith(f"policy.generation.vllm_cfg.{key}")


def test_options_of_nemo_rls_side_that_are_off_load(tiny):
    config = generation_config(tiny, async_engine=True, use_tqdm=True, use_deep_gemm=False,
                               num_last_layers_in_bf16=0, http_refit_server_port=None)
    assert read_nemo_rl_config(config).fleet.engine["kind"] == "vllm"


@pytest.mark.parametrize("mode", [m for m in ROUTER_MODES if m != "direct"])
def test_every_router_mode_of_dynamos_frontend_is_taken(tiny, mode):
    config = generation_config(tiny)
    config["dynamo_cfg"]["frontend_args"]["router_mode"] = mode
    assert read_nemo_rl_config(config).fleet.router == mode


def test_direct_routing_is_refused_with_its_reason():
    with pytest.raises(ConfigError, match="router='direct'.*name none"):
        parse_config({"engine": {"kind": "memory"}, "router": "direct"})


def test_a_hub_id_is_found_in_the_local_hugging_face_cache(tiny, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    entry = cache / f"models--{HUB_ID.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in tiny.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    fleet = read_nemo_rl_config(generation_config(HUB_ID)).fleet
    assert fleet.model == str(snapshot)
    assert fleet.served_model_name == HUB_ID  # what clients ask for keeps NeMo-RL's name


def test_a_hub_id_missing_from_the_cache_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ConfigError) as caught:
        read_nemo_rl_config(generation_config(HUB_ID))
    assert f"model={HUB_ID!r}" in str(caught.value)
    assert "local Hugging Face cache" in str(caught.value)


def test_gpu_fleets_receive_what_nemo_rls_trainer_sends_cpu_ones_the_packed_protocol(tiny):
    on_gpu = read_nemo_rl_config(generation_config(tiny), GpuCluster(2)).fleet
    assert on_gpu.sender_spec.protocol is RefitProtocol.VLLM
    assert (on_gpu.sender_spec.buffer_bytes, on_gpu.sender_spec.num_buffers) == (1 << 30, 2)
    assert read_nemo_rl_config(generation_config(tiny)).fleet.sender_spec.protocol is RefitProtocol.PACKED
    chosen = generation_config(tiny)
    chosen["rollout_fleet"] = {"engine": {"refit_protocol": "rollout-fleet-packed-v1"}}
    fleet = read_nemo_rl_config(chosen, GpuCluster(2)).fleet
    assert fleet.sender_spec.protocol is RefitProtocol.PACKED  # chosen in policy.generation
    assert fleet.engine["pipeline_parallel_size"] == 1  # NeMo-RL's options kept beside it


def test_a_colocated_gpu_fleet_takes_nemo_rls_ipc_stream_through_the_packed_protocol(tiny):
    colocated = generation_config(tiny)
    colocated["colocated"] = {"enabled": True}
    fleet = read_nemo_rl_config(colocated, GpuCluster(2)).fleet
    assert fleet.colocation.enabled
    assert fleet.sender_spec.protocol is RefitProtocol.PACKED  # vLLM's own takes no IPC stream


def test_each_vllm_worker_gets_its_own_engine_seed(tmp_path):
    config = parse_config({"engine": {"kind": "vllm", "seed": 7}, "num_workers": 3,
                           "run_dir": str(tmp_path)})
    fleet = Fleet(config, None, tmp_path, "secret")
    seeds = [fleet.worker_config(i).engine["seed"] for i in range(3)]
    assert seeds == [7, 8, 9]


def test_memory_engine_seed_is_its_model_and_stays_alike(tmp_path):
    folder = write_model_folder(tmp_path / "m", context_length=64)
    config = parse_config({"engine": {"kind": "memory", "seed": 3}, "model": str(folder),
                           "num_workers": 2, "run_dir": str(tmp_path)})
    fleet = Fleet(config, None, tmp_path, "secret")
    assert [fleet.worker_config(i).engine["seed"] for i in range(2)] == [3, 3]


# -- NeMo-RL's colocated section ------------------------------------------------------------------
def test_colocated_generation_becomes_the_fleets_colocation(tiny):
    config = generation_config(tiny)
    config["colocated"] = {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}}
    fleet = read_nemo_rl_config(config, GpuCluster(2)).fleet
    assert fleet.colocation.enabled and fleet.colocation.sleep_level == 1
    assert fleet.colocated_workers == {"worker-0": (0,), "worker-1": (1,)}  # worker i, rank i
    options = Fleet(fleet, placement=None, run_dir=tiny, secret="s").worker_config(0).engine
    assert options["enable_sleep_mode"] is True  # vLLM starts with sleep mode on the GPUs


def test_dedicated_generation_is_no_colocation_and_its_resources_are_checked(tiny):
    config = generation_config(tiny)
    config["colocated"] = {"enabled": False, "resources": {"gpus_per_node": 1, "num_nodes": 1}}
    fleet = read_nemo_rl_config(config, GpuCluster(2)).fleet
    assert not fleet.colocation.enabled and fleet.colocated_workers == {}
    assert "enable_sleep_mode" not in Fleet(fleet, placement=None, run_dir=tiny,
                                            secret="s").worker_config(0).engine


@pytest.mark.parametrize("colocated, field", [
    ({"enabled": "yes"}, "policy.generation.colocated.enabled"),
    ({"enabled": True, "resources": {"gpus_per_node": 0}},
     "policy.generation.colocated.resources.gpus_per_node"),
    ({"enabled": True, "resources": {"gpus": 1}}, "policy.generation.colocated.resources.gpus"),
    ({"enabled": True, "placement": "x"}, "policy.generation.colocated.placement"),
    ("on", "policy.generation.colocated"),
])
def test_a_bad_colocated_section_is_refused_by_name(tiny, colocated, field):
    config = generation_config(tiny)
    config["colocated"] = colocated
    with pytest.raises(InvalidValue) as caught:
        read_nemo_rl_config(config, GpuCluster(2))
    assert str(caught.value).startswith(field)


def test_the_rollout_fleet_section_sets_the_sleep_level_over_nemo_rls_colocation(tiny):
    config = generation_config(tiny)
    config["colocated"] = {"enabled": True}
    config["rollout_fleet"] = {"colocation": {"sleep_level": 2}}
    fleet = read_nemo_rl_config(config, GpuCluster(1)).fleet
    assert fleet.colocation.enabled and fleet.colocation.sleep_level == 2


def test_an_explicit_cpu_device_wins_over_a_gpu_cluster_and_the_engine_follows_it(tiny):
    config = generation_config(tiny, gpu_memory_utilization=0.6)
    config["rollout_fleet"] = {"device": "cpu"}
    fleet = read_nemo_rl_config(config, GpuCluster(2)).fleet
    assert fleet.device == "cpu"
    # No NCCL transfer engine and no GPU share taken as a share of host memory on the CPU.
    assert "device" not in fleet.engine and "gpu_memory_utilization" not in fleet.engine
    assert fleet.sender_spec.protocol is RefitProtocol.PACKED
    on_gpu = read_nemo_rl_config(generation_config(tiny, gpu_memory_utilization=0.6),
                                 GpuCluster(2)).fleet
    assert on_gpu.device == "gpu" and on_gpu.engine["gpu_memory_utilization"] == 0.6
    assert on_gpu.engine["device"] == "gpu"


def test_what_vllm_is_given_on_a_cpu_fleet_under_a_gpu_cluster(tiny):
    """The engine arguments themselves (what vLLM's AsyncEngineArgs get), not only the table:
    the project's packed transfer engine, never vLLM's NCCL one, and the KV cache a CPU
    fleet's, never NeMo-RL's share of GPU memory taken as a share of host memory."""
    from rollout_fleet.adapters.vllm.host.config import CPU_KV_CACHE_BYTES, TRANSFER_BACKENDS

    config = generation_config(tiny, gpu_memory_utilization=0.6)
    config["rollout_fleet"] = {"device": "cpu"}
    engine = read_nemo_rl_config(config, GpuCluster(2)).fleet.engine_choice.settings.engine
    kwargs = engine.engine_kwargs()
    assert kwargs["weight_transfer_config"] == {"backend": TRANSFER_BACKENDS[RefitProtocol.PACKED]}
    assert kwargs["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    assert "gpu_memory_utilization" not in kwargs
    on_gpu = read_nemo_rl_config(generation_config(tiny, gpu_memory_utilization=0.6),
                                 GpuCluster(2)).fleet.engine_choice.settings.engine.engine_kwargs()
    assert on_gpu["weight_transfer_config"] == {"backend": "nccl"}
    assert on_gpu["gpu_memory_utilization"] == 0.6 and "kv_cache_memory_bytes" not in on_gpu


def test_a_device_that_is_neither_cpu_nor_gpu_is_refused_by_name(tiny):
    config = generation_config(tiny)
    config["rollout_fleet"] = {"device": "cuda"}
    with pytest.raises(InvalidValue) as refused:
        read_nemo_rl_config(config, GpuCluster(2))
    assert refused.value.field == "policy.generation.rollout_fleet.device"
    assert refused.value.value == "cuda"
