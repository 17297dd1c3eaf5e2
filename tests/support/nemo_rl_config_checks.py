"""The checks NeMo-RL applies to ``policy.generation`` before it builds its Dynamo backend.

Restated in this project's own words from reading NeMo-RL's validator at commit 7ea279ab
(``nemo_rl/models/generation/dynamo/config.py``); no code of it is copied. A config it refuses
raises ValueError naming the field; keys NeMo-RL's Dynamo backend ignores are reported as
warnings, as NeMo-RL reports them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

ROUTER_MODES = ("round-robin", "random", "power-of-two", "kv", "direct", "least-loaded",
                "device-aware-weighted")
ENDPOINT_TYPES = ("chat", "completions")

# vllm_cfg keys NeMo-RL's Dynamo backend knows, by what it does with them.
PASSED_AS_FLAGS = {"tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization",
                   "max_model_len", "kv_cache_dtype", "load_format", "precision",
                   "enforce_eager"}
SHAPES_THE_FLEET = {"env_vars", "expert_parallel_size"}
MOVED_TO = {"http_server_serving_chat_kwargs": "dynamo_cfg.worker_args.custom_jinja_template "
                                               "and tool_call_parser",
            "reasoning_parser_plugin": "dynamo_cfg.worker_args.reasoning_parser",
            "tool_parser_plugin": "dynamo_cfg.worker_args.tool_call_parser"}
IGNORED_WITH_A_WARNING = {"cap_max_tokens_to_context", "is_mx", "num_first_layers_in_bf16",
                          "num_last_layers_in_bf16", "skip_tokenizer_init", "use_deep_gemm"}
SET_BY_THE_RUNTIME = {"enable_vllm_metrics_logger", "expose_http_server", "logprobs_mode",
                      "vllm_metrics_logger_interval"}
NOT_APPLICABLE = {"async_engine", "enable_return_routed_experts", "http_refit_api_key_env_var",
                  "http_refit_server_port", "use_tqdm", "zmq_refit_server_port"}
ONE_RANK_ONLY = {"data_parallel_size", "decode_context_parallel_size",
                 "prefill_context_parallel_size"}
KNOWN_VLLM_KEYS = (PASSED_AS_FLAGS | SHAPES_THE_FLEET | set(MOVED_TO) | IGNORED_WITH_A_WARNING
                   | SET_BY_THE_RUNTIME | NOT_APPLICABLE | ONE_RANK_ONLY)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_positive(value: Any) -> bool:
    return _is_number(value) and value > 0


def _is_positive_int(value: Any) -> bool:
    return _is_positive(value) and float(value).is_integer()


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _one_of(*allowed: str) -> Callable[[Any], bool]:
    return lambda value: value in allowed


def _is_endpoint_list(value: Any) -> bool:
    return (isinstance(value, list) and bool(value) and len(set(value)) == len(value)
            and all(item in ENDPOINT_TYPES for item in value))


def _is_str_map(value: Any) -> bool:
    return isinstance(value, Mapping) and all(_is_str(k) and _is_str(v) for k, v in value.items())


WORKER_ARGS = {"tool_call_parser": _optional(_is_str), "reasoning_parser": _optional(_is_str),
               "exclude_tools_when_tool_choice_none": _is_bool,
               "enable_structural_tag": _is_bool,
               "structural_tag_scope": _one_of("auto", "always"),
               "structural_tag_schema": _one_of("auto", "strict"),
               "custom_jinja_template": _optional(_is_str),
               "endpoint_types": _is_endpoint_list, "extra_cli_args": _is_str_list}
FRONTEND_ARGS = {"tokenizer": _one_of("default", "fastokens"), "tokenizer_cache": _is_bool,
                 "tokenizer_cache_bytes": _is_positive_int,
                 "router_mode": _one_of(*ROUTER_MODES), "router_reset_states": _is_bool,
                 "extra_cli_args": _is_str_list}
DYNAMO_CFG = {"engine": _one_of("vllm"), "startup_timeout_s": _is_positive,
              "request_timeout_s": _is_positive, "control_timeout_s": _is_positive,
              "metrics_include_prefixes": _optional(_is_str_list),
              "metrics_exclude_prefixes": _optional(_is_str_list)}
VLLM_CFG_REQUIRED = {"async_engine": _is_bool, "tensor_parallel_size": _is_positive_int,
                     "pipeline_parallel_size": _is_positive_int,
                     "expert_parallel_size": _is_positive_int,
                     "gpu_memory_utilization": _is_number, "max_model_len": _is_positive_int,
                     "kv_cache_dtype": _is_str, "load_format": _is_str, "precision": _is_str,
                     "enforce_eager": _is_bool, "expose_http_server": _is_bool,
                     "enable_vllm_metrics_logger": _is_bool,
                     "vllm_metrics_logger_interval": _is_positive,
                     "env_vars": _optional(_is_str_map)}


def _section(config: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = config.get(key)
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}.{key} must be a mapping, got {value!r}")
    return value


def _check_fields(section: Mapping[str, Any], checks: Mapping[str, Callable[[Any], bool]],
                  where: str, *, closed: bool) -> None:
    """Each field present and passing its check; with ``closed``, no other field."""
    for key, check in checks.items():
        if key not in section:
            raise ValueError(f"{where}.{key} is missing")
        if not check(section[key]):
            raise ValueError(f"{where}.{key}={section[key]!r} is not accepted")
    unknown = sorted(set(section) - set(checks))
    if closed and unknown:
        raise ValueError(f"{where} has unknown fields {unknown}")


def _check_dynamo_cfg(config: Mapping[str, Any]) -> None:
    where = "policy.generation.dynamo_cfg"
    dynamo = _section(config, "dynamo_cfg", "policy.generation")
    _check_fields({k: v for k, v in dynamo.items() if k not in ("worker_args", "frontend_args")},
                  DYNAMO_CFG, where, closed=True)
    _check_fields(_section(dynamo, "worker_args", where), WORKER_ARGS, f"{where}.worker_args",
                  closed=True)
    _check_fields(_section(dynamo, "frontend_args", where), FRONTEND_ARGS,
                  f"{where}.frontend_args", closed=True)


def _check_vllm_values(vllm: Mapping[str, Any]) -> None:
    where = "policy.generation.vllm_cfg"
    if vllm["expert_parallel_size"] not in (1, vllm["tensor_parallel_size"]):
        raise ValueError(f"{where}.expert_parallel_size must be 1 or tensor_parallel_size")
    if vllm["precision"].lower() not in ("bf16", "bfloat16"):
        raise ValueError(f"{where}.precision={vllm['precision']!r}: only bfloat16 is refit")
    if vllm["kv_cache_dtype"] != "auto":
        raise ValueError(f"{where}.kv_cache_dtype={vllm['kv_cache_dtype']!r}: must be 'auto'")
    if vllm.get("is_mx"):
        raise ValueError(f"{where}.is_mx: MXFP8 generation is not served by Dynamo")
    if int(vllm.get("num_first_layers_in_bf16") or 0) or int(vllm.get("num_last_layers_in_bf16")
                                                             or 0):
        raise ValueError(f"{where}: layers kept in bf16 (mixed with FP8) are not served")
    if vllm.get("logprobs_mode") not in (None, "processed_logprobs"):
        raise ValueError(f"{where}.logprobs_mode={vllm['logprobs_mode']!r}: must be "
                         "'processed_logprobs'")
    for key, instead in MOVED_TO.items():
        if vllm.get(key) is not None:
            raise ValueError(f"{where}.{key} is not read; set {instead}")


def _warn_ignored_vllm_keys(vllm: Mapping[str, Any]) -> None:
    where = "policy.generation.vllm_cfg"
    for key in sorted(IGNORED_WITH_A_WARNING & set(vllm)):
        if vllm[key]:
            warnings.warn(f"{where}.{key} has no effect on a Dynamo backend", stacklevel=3)
    unknown = sorted(k for k, v in vllm.items() if v is not None and k not in KNOWN_VLLM_KEYS)
    if unknown:
        warnings.warn(f"{where} keys a Dynamo backend does not read: {unknown}", stacklevel=3)


def _check_backend_boundary(config: Mapping[str, Any]) -> None:
    where = "policy.generation"
    vllm, kwargs = config["vllm_cfg"], config["vllm_kwargs"]
    for key in ("sglang_cfg", "trtllm_cfg", "quant_cfg", "real_quant"):
        if config.get(key):
            raise ValueError(f"{where}.{key} cannot be set for the Dynamo backend")
    colocated = config.get("colocated")
    if isinstance(colocated, Mapping) and colocated.get("enabled"):
        raise ValueError(f"{where}.colocated.enabled must be false for the Dynamo backend")
    if config.get("refit_transport") is not None:
        raise ValueError(f"{where}.refit_transport must be null: refit is by collective only")
    if kwargs.get("speculative_config") or vllm.get("speculative_config"):
        raise ValueError(f"{where}.vllm_kwargs.speculative_config: draft weights are not refit")
    if kwargs.get("quantization") is not None:
        raise ValueError(f"{where}.vllm_kwargs.quantization cannot be set")
    for key in sorted(ONE_RANK_ONLY):
        for source, section in (("vllm_cfg", vllm), ("vllm_kwargs", kwargs)):
            if section.get(key) is not None and int(section[key]) != 1:
                raise ValueError(f"{where}.{source}.{key} must be 1: ranks are TP x PP")
    stops = config.get("stop_strings")
    if stops is not None and len(stops) > 32:
        raise ValueError(f"{where}.stop_strings: {len(stops)} given, 32 at most")


def check_dynamo_generation_config(config: Mapping[str, Any]) -> None:
    """Raise ValueError where NeMo-RL refuses ``config`` for ``backend: dynamo``."""
    if config.get("backend") != "dynamo":
        raise ValueError(f"policy.generation.backend={config.get('backend')!r}: must be 'dynamo'")
    _check_dynamo_cfg(config)
    vllm = config.get("vllm_cfg")
    if not isinstance(vllm, Mapping) or not vllm:
        raise ValueError("policy.generation.vllm_cfg must be a non-empty mapping")
    _check_fields(vllm, VLLM_CFG_REQUIRED, "policy.generation.vllm_cfg", closed=False)
    _check_vllm_values(vllm)
    _warn_ignored_vllm_keys(vllm)
    if not isinstance(config.get("vllm_kwargs"), Mapping):
        raise ValueError("policy.generation.vllm_kwargs must be a mapping")
    _check_backend_boundary(config)
