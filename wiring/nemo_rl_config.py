"""NeMo-RL's ``policy.generation`` dict, read: every key passed on to the fleet's config or
refused by name (docs/running-a-fleet.md lists them and what each becomes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import RefitProtocol
from rollout_fleet.core.validate import check_bool
from rollout_fleet.wiring.config import FleetConfig, parse_config

_PRECISIONS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
               "float16": "float16", "fp32": "float32", "float32": "float32"}
# vllm_cfg keys read here, and those that configure NeMo-RL's side or upstream's own runtime
# (accepted, with nothing for vLLM to do here: docs/running-a-fleet.md lists them).
_VLLM_CFG_READ = {"tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
                  "precision", "max_model_len", "gpu_memory_utilization", "enforce_eager",
                  "load_format", "kv_cache_dtype", "logprobs_mode", "env_vars",
                  "enable_vllm_metrics_logger", "vllm_metrics_logger_interval",
                  "expose_http_server"}
_VLLM_CFG_NEMO_RL_SIDE = {"async_engine", "use_tqdm"}  # always async here; no progress bars
# Features of NeMo-RL's in-process vLLM or its other refit paths: accepted when off.
_VLLM_CFG_OFF_ONLY = {"use_deep_gemm", "num_last_layers_in_bf16", "num_first_layers_in_bf16",
                      "is_mx", "skip_tokenizer_init", "enable_return_routed_experts",
                      "cap_max_tokens_to_context", "reset_encoder_cache_after_weight_update",
                      "http_refit_api_key_env_var", "http_refit_server_port",
                      "zmq_refit_server_port"}
PREFIX = "policy.generation"


@dataclasses.dataclass(frozen=True)
class DropInSettings:
    """What the NeMo-RL config dict says, in the project's terms."""

    fleet: FleetConfig
    generation: dict[str, Any]  # GenerationConfig fields for the native driver
    pad_token_id: int | None


def read_nemo_rl_config(config: Mapping[str, Any], cluster: Any = None) -> DropInSettings:
    """NeMo-RL's ``policy.generation`` dict -> a FleetConfig and the native driver's settings."""
    if not isinstance(config, Mapping):
        raise InvalidValue(PREFIX, type(config).__name__, "must be a mapping")
    if _get(config, "backend") != "dynamo":
        raise InvalidValue(f"{PREFIX}.backend", config.get("backend"), "must be 'dynamo'")
    dynamo, vllm = _section(config, "dynamo_cfg"), _section(config, "vllm_cfg")
    _refuse_unoffered(config, dynamo, vllm)
    ranks = int(_get(vllm, "tensor_parallel_size", "vllm_cfg")) \
        * int(vllm.get("pipeline_parallel_size") or 1)
    temperature = float(_get(config, "temperature"))
    interval = float(vllm.get("vllm_metrics_logger_interval") or 1.0)
    extension = dict(config.get("rollout_fleet") or {})
    on_gpu = _fleet_device(extension, cluster) == "gpu"
    colocation = _colocation(config.get("colocated"))
    fleet = {
        "model": _get(config, "model_name"), "served_model_name": _get(config, "model_name"),
        "engine": _engine(vllm, config.get("vllm_kwargs") or {}, on_gpu,
                          colocated=bool(colocation)),
        "ranks_per_worker": ranks, "max_model_len": int(_get(vllm, "max_model_len", "vllm_cfg")),
        "max_new_tokens": int(_get(config, "max_new_tokens")),
        "stop_strings": list(config.get("stop_strings") or []),
        "env": _env_vars(vllm),
        "timeouts": {"start_s": float(_get(dynamo, "startup_timeout_s", "dynamo_cfg")),
                     "request_s": float(_get(dynamo, "request_timeout_s", "dynamo_cfg")),
                     "refit_s": float(_get(dynamo, "control_timeout_s", "dynamo_cfg"))},
    }
    chat = _chat_settings(dynamo)
    if chat:
        fleet["chat"] = chat
    router = (dynamo.get("frontend_args") or {}).get("router_mode")
    if router is not None:
        fleet["router"] = router
    if colocation:
        fleet["colocation"] = colocation
    if "colocation" in extension and isinstance(extension["colocation"], Mapping):
        extension["colocation"] = {**colocation, **extension["colocation"]}
    if "engine" in extension:  # the fleet's own engine options, over those NeMo-RL's keys give
        extension["engine"] = _merged_engine(fleet["engine"], extension["engine"])
    if "env" in extension:
        extension["env"] = {**fleet["env"], **dict(extension["env"])}
    if "num_workers" not in extension:
        fleet["num_workers"] = _workers_of(cluster, ranks)
    fleet["device"] = "gpu" if on_gpu else "cpu"
    fleet_config = parse_config({**fleet, **extension}, source=f"{PREFIX} (NeMo-RL config)")
    top_k = config.get("top_k")
    generation = {
        "temperature": temperature,  # 0: greedy
        "stop_token_ids": tuple(config.get("stop_token_ids") or ()),
        "top_p": float(_get(config, "top_p")),
        "top_k": -1 if top_k is None else int(top_k),
        "metrics_interval_s": interval if vllm.get("enable_vllm_metrics_logger") else 0.0,
    }
    return DropInSettings(fleet_config, generation, pad_token_id=config.get("_pad_token_id"))

def _colocation(colocated: Any) -> dict[str, Any]:
    """NeMo-RL's ``colocated`` section -> the fleet's ``[colocation]``: ``enabled`` (the
    workers share the trainer's GPUs, worker i with trainer rank i, and sleep between
    generation phases); ``resources`` (NeMo-RL's size of a dedicated generation cluster, read
    only when ``enabled`` is false) is checked, and the fleet's size still comes from the
    cluster NeMo-RL hands over."""
    if colocated is None:
        return {}
    where = f"{PREFIX}.colocated"
    if not isinstance(colocated, Mapping):
        raise InvalidValue(where, colocated, "must be a mapping (enabled, resources)")
    unknown = sorted(set(colocated) - {"enabled", "resources"})
    if unknown:
        raise InvalidValue(f"{where}.{unknown[0]}", colocated[unknown[0]],
                           "unknown key; NeMo-RL's colocated section has enabled and resources")
    enabled = check_bool(f"{where}.enabled", colocated.get("enabled", False))
    resources = colocated.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise InvalidValue(f"{where}.resources", resources, "must be a mapping")
    for key, value in resources.items():
        if key not in ("gpus_per_node", "num_nodes"):
            raise InvalidValue(f"{where}.resources.{key}", value,
                               "unknown key; NeMo-RL's resources are gpus_per_node and num_nodes")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidValue(f"{where}.resources.{key}", value, "must be null or an int >= 1")
    return {"enabled": True} if enabled else {}


def _engine(vllm: Mapping[str, Any], vllm_kwargs: Mapping[str, Any], on_gpu: bool, *,
            colocated: bool) -> dict[str, Any]:
    """vLLM's engine options from ``vllm_cfg`` and ``vllm_kwargs``: each key passed on, or
    refused by name; none dropped."""
    precision = str(vllm.get("precision") or "bfloat16").lower()
    if precision not in _PRECISIONS:
        raise InvalidValue(f"{PREFIX}.vllm_cfg.precision", precision,
                           f"must be one of {sorted(_PRECISIONS)}")
    tensor = int(vllm.get("tensor_parallel_size") or 1)
    engine: dict[str, Any] = {"kind": "vllm", "dtype": _PRECISIONS[precision],
                              "max_model_len": int(_get(vllm, "max_model_len", "vllm_cfg")),
                              "tensor_parallel_size": tensor,
                              "pipeline_parallel_size": int(vllm.get("pipeline_parallel_size") or 1)}
    if on_gpu:
        # What NeMo-RL's trainer sends: apart, vLLM's own packed NCCL broadcast; colocated, its
        # IPC stream, which the fleet's own transfer engine loads.
        protocol = RefitProtocol.PACKED if colocated else RefitProtocol.VLLM
        engine.update(device="gpu", refit_protocol=protocol.value)
    for key in ("gpu_memory_utilization", "enforce_eager") if on_gpu else ("enforce_eager",):
        if vllm.get(key) is not None:
            engine[key] = vllm[key]
    # On a CPU fleet a share of GPU memory means nothing (vLLM would take it as a share of host
    # memory, 13.5 GiB per worker on a 24 GiB machine): the KV cache is sized as any CPU
    # fleet's (the engine's kv_cache_memory_bytes, or vLLM's CPU default).
    extra = dict(vllm_kwargs)
    extra.update(_passed_to_vllm(vllm, tensor))
    if "max_num_seqs" in extra:
        engine["max_num_seqs"] = int(extra.pop("max_num_seqs"))
    if "seed" in extra:  # the base: worker i's engine samples with seed + i
        engine["seed"] = int(extra.pop("seed"))
    if extra:
        engine["extra_engine_args"] = extra
    return engine


def _fleet_device(extension: Mapping[str, Any], cluster: Any) -> str:
    """The fleet's device: ``rollout_fleet.device`` when it says one, else the trainer's
    cluster's (NeMo-RL's clusters are GPU ones unless they say otherwise), else the CPU."""
    device = extension.get("device")
    if device is not None:
        if device not in ("cpu", "gpu"):
            raise InvalidValue(f"{PREFIX}.rollout_fleet.device", device, "must be 'cpu' or 'gpu'")
        return device
    return "gpu" if cluster is not None and getattr(cluster, "use_gpus", True) else "cpu"


def _passed_to_vllm(vllm: Mapping[str, Any], tensor: int) -> dict[str, Any]:
    """``vllm_cfg`` keys vLLM takes as engine arguments, in vLLM's names."""
    passed: dict[str, Any] = {"logprobs_mode": _logprobs_mode(vllm)}
    expert = int(vllm.get("expert_parallel_size") or 1)
    if expert not in (1, tensor):
        raise InvalidValue(f"{PREFIX}.vllm_cfg.expert_parallel_size", expert,
                           f"must be 1 or tensor_parallel_size ({tensor}): vLLM's expert "
                           "parallel spans an engine's tensor parallel ranks")
    if expert > 1:
        passed["enable_expert_parallel"] = True
    for key in ("load_format", "kv_cache_dtype"):
        if vllm.get(key) is not None:
            passed[key] = vllm[key]
    unknown = sorted(set(vllm) - _VLLM_CFG_READ - _VLLM_CFG_NEMO_RL_SIDE - _VLLM_CFG_OFF_ONLY)
    unknown += sorted(key for key in _VLLM_CFG_OFF_ONLY if vllm.get(key))
    if unknown:
        raise InvalidValue(f"{PREFIX}.vllm_cfg.{unknown[0]}", vllm[unknown[0]],
                           "not offered by this backend (docs/running-a-fleet.md lists the "
                           "vllm_cfg keys it reads); vLLM engine arguments go in "
                           "policy.generation.vllm_kwargs")
    return passed


def _logprobs_mode(vllm: Mapping[str, Any]) -> str:
    mode = vllm.get("logprobs_mode")
    if mode not in (None, "processed_logprobs"):
        raise InvalidValue(f"{PREFIX}.vllm_cfg.logprobs_mode", mode,
                           "must be 'processed_logprobs' (temperature, top-p and top-k applied, "
                           "as the trainer's importance weights expect)")
    return "processed_logprobs"


def _env_vars(vllm: Mapping[str, Any]) -> dict[str, str]:
    env = vllm.get("env_vars") or {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                               for k, v in env.items()):
        raise InvalidValue(f"{PREFIX}.vllm_cfg.env_vars", env, "must map names to strings")
    return dict(env)


def _merged_engine(from_nemo_rl: Mapping[str, Any], own: Any) -> Any:
    """The ``rollout_fleet.engine`` section: over NeMo-RL's vLLM options when it keeps vLLM
    (e.g. ``refit_protocol``), or in their place when it names another engine kind."""
    if not isinstance(own, Mapping) or own.get("kind", "vllm") != "vllm":
        return own
    return {**from_nemo_rl, **own}


def _refuse_unoffered(config: Mapping[str, Any], dynamo: Mapping[str, Any],
                      vllm: Mapping[str, Any]) -> None:
    if vllm.get("expose_http_server") is not None:  # true: the agent door (wiring/nemo_rl.py)
        check_bool(f"{PREFIX}.vllm_cfg.expose_http_server", vllm["expose_http_server"])
    if config.get("refit_transport") is not None:
        raise InvalidValue(f"{PREFIX}.refit_transport", config["refit_transport"],
                           "must be null: this backend refits over the collective only")
    worker_args = dynamo.get("worker_args") or {}
    for key in ("extra_cli_args",):
        for section, args in (("worker_args", worker_args),
                              ("frontend_args", dynamo.get("frontend_args") or {})):
            if args.get(key):
                raise InvalidValue(f"{PREFIX}.dynamo_cfg.{section}.{key}", args[key],
                                   "not offered: the fleet builds its workers' and frontend's "
                                   "arguments itself; use the rollout_fleet section")


def _chat_settings(dynamo: Mapping[str, Any]) -> dict[str, str]:
    """``worker_args.tool_call_parser`` / ``reasoning_parser`` / ``custom_jinja_template``:
    the fleet's ``chat`` table, each checked here so that a bad one is named by NeMo-RL's key."""
    from rollout_fleet.adapters.dynamo.chat import CHAT_KEYS, check_chat_settings

    worker_args = dynamo.get("worker_args") or {}
    asked = {key: worker_args[key] for key in CHAT_KEYS if worker_args.get(key) is not None}
    return check_chat_settings(asked, field_prefix=f"{PREFIX}.dynamo_cfg.worker_args")


def groups_of(cluster: Any) -> list:
    """The placement groups of NeMo-RL's cluster (``RayVirtualCluster.get_placement_groups``),
    one bundle per engine rank; none when it has none (the fleet then reserves its own)."""
    get = getattr(cluster, "get_placement_groups", None)
    return list(get()) if callable(get) else []


def _workers_of(cluster: Any, ranks: int) -> int:
    world_size = getattr(cluster, "world_size", None)
    if world_size is None:
        return 1
    size = int(world_size() if callable(world_size) else world_size)
    if size < ranks or size % ranks:
        raise InvalidValue("cluster.world_size()", size,
                           f"must be a multiple of the ranks of one engine ({ranks})")
    return size // ranks


def _section(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = _get(config, key)
    if not isinstance(value, Mapping):
        raise InvalidValue(f"{PREFIX}.{key}", value, "must be a mapping")
    return value


def _get(config: Mapping[str, Any], key: str, section: str | None = None) -> Any:
    if key not in config:
        where = f"{PREFIX}.{section}" if section else PREFIX
        raise InvalidValue(where, sorted(config), f"has no {key!r}")
    return config[key]
