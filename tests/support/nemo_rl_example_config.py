"""``policy.generation`` of NeMo-RL's Dynamo example run (``grpo_math_1B_dynamo.yaml`` over
its base ``grpo_math_1B.yaml``, at commit 7ea279ab), as NeMo-RL resolves it: the keys and values
only, restated here as a dict, with its interpolations (the 512-token sequence length, the
validation sampling that follows the training one) already applied."""

from __future__ import annotations

import copy

SEQUENCE_LENGTH = 512  # policy.max_total_sequence_length of the example

_FRONTEND = {"tokenizer": "default", "tokenizer_cache": False,
             "tokenizer_cache_bytes": 50 * 1024 * 1024, "router_mode": "kv",
             "router_reset_states": True, "extra_cli_args": []}
_WORKERS = {"tool_call_parser": None, "reasoning_parser": None,
            "exclude_tools_when_tool_choice_none": True, "enable_structural_tag": False,
            "structural_tag_scope": "auto", "structural_tag_schema": "auto",
            "custom_jinja_template": None, "endpoint_types": ["chat", "completions"],
            "extra_cli_args": []}
_DYNAMO = {"engine": "vllm", "startup_timeout_s": 600, "request_timeout_s": 900,
           "control_timeout_s": 600, "metrics_include_prefixes": None,
           "metrics_exclude_prefixes": None, "worker_args": _WORKERS, "frontend_args": _FRONTEND}
_VLLM = {
    "async_engine": True, "precision": "bfloat16", "kv_cache_dtype": "auto",
    "logprobs_mode": "processed_logprobs", "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1, "expert_parallel_size": 1, "gpu_memory_utilization": 0.6,
    "max_model_len": SEQUENCE_LENGTH, "enforce_eager": True, "use_tqdm": True,
    "use_deep_gemm": False, "num_first_layers_in_bf16": 0, "num_last_layers_in_bf16": 0,
    "enable_vllm_metrics_logger": True, "vllm_metrics_logger_interval": 1.0,
    "http_refit_api_key_env_var": None, "http_refit_server_port": None,
    "zmq_refit_server_port": None, "reset_encoder_cache_after_weight_update": False,
    "expose_http_server": False, "env_vars": {"NCCL_MNNVL_ENABLE": "0"},
}
# Sections the base file sets for its other backends; NeMo-RL's Dynamo path leaves them be.
_MEGATRON_GENERATION = {
    "max_model_len": SEQUENCE_LENGTH, "cuda_graph_impl": "local",
    "inference_cuda_graph_scope": "block", "buffer_size_gb": 10, "num_cuda_graphs": 4,
    "block_size_tokens": 256, "use_cuda_graphs_for_non_decode_steps": True,
    "enable_chunked_prefill": True, "enable_prefix_caching": False, "max_tokens": 16384,
    "kv_cache_management_mode": "persist", "materialize_only_last_token_logits": True,
    "num_speculative_tokens": 0, "refit_backend": "nccl", "parsers": [],
    "expose_http_server": False,
}
_NIXL_REFIT = {"update_weights_bucket_memory_ratio": 0.05, "device": "cuda",
               "backend_name": "UCX", "backend_init_params": None, "release_after_refit": False,
               "shard_expert_weights": False}
_SAMPLING = {"temperature": 0.7, "top_p": 0.95, "top_k": 50}

_GENERATION = {
    "backend": "dynamo", "max_new_tokens": 128, **_SAMPLING,
    **{f"val_{key}": value for key, value in _SAMPLING.items()},
    "stop_token_ids": None, "stop_strings": None, "port_range_low": 3000,
    "port_range_high": 4999, "refit_transport": None, "real_quant_export_cpu_offload": True,
    "refit_cfg": {"nixl": _NIXL_REFIT}, "mcore_generation_config": _MEGATRON_GENERATION,
    "dynamo_cfg": _DYNAMO, "vllm_cfg": _VLLM, "vllm_kwargs": {"max_num_seqs": 16},
    "colocated": {"enabled": False, "resources": {"gpus_per_node": 1, "num_nodes": 1}},
}


def example_generation_config() -> dict:
    """A fresh copy, free for a test to change."""
    return copy.deepcopy(_GENERATION)
