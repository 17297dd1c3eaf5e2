"""NeMo-RL's ``DynamoGeneration``, as a drop-in: the constructor, config dict, methods and output
shapes of NeMo-RL's generation interface for its Dynamo backend, over a fleet this object builds,
owns, and stops at ``shutdown()``.

    generation = DynamoGeneration(cluster, config["policy"]["generation"])   # as NeMo-RL does

Underneath, the project's own pieces: the config dict becomes a ``FleetConfig`` (``Fleet``
starts it) and a ``GenerationConfig`` for the native driver
(``rollout_fleet.adapters.nemo_rl.DynamoGeneration``, reachable as ``.native``).

Keys read (NeMo-RL's names): ``model_name``, ``max_new_tokens``, ``temperature`` (0 = greedy),
``top_p``, ``top_k``, ``stop_strings``, ``stop_token_ids``, ``_pad_token_id``;
``dynamo_cfg``: ``startup_timeout_s``, ``request_timeout_s``, ``control_timeout_s``,
``frontend_args.router_mode``; ``vllm_cfg``: ``tensor_parallel_size``,
``pipeline_parallel_size``, ``max_model_len``, ``precision``, ``gpu_memory_utilization``,
``enforce_eager``, ``enable_vllm_metrics_logger``, ``vllm_metrics_logger_interval``;
``vllm_kwargs`` (passed to vLLM). What this backend cannot do is refused by name
(``expose_http_server``, a colocated engine, chat parsers and templates). An optional
``rollout_fleet`` section holds ``FleetConfig`` fields that NeMo-RL has no key for (the engine
kind, workers, device, run folder); without it the worker count comes from the cluster's
``world_size()`` divided by the ranks of one engine (GPU workers), and with no cluster one CPU
worker runs on this machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import VLLM_PROTOCOL
from rollout_fleet.wiring.config import FleetConfig, parse_config
from rollout_fleet.wiring.fleet import Fleet, placement_for

# NeMo-RL's logger keys -> the native driver's timelines.
LOGGER_METRICS = {"inflight_batch_sizes": "inflight_requests",
                  "num_pending_samples": "pending_requests",
                  "kv_cache_usage_perc": "kv_cache_usage",
                  "generation_tokens": "generated_tokens"}
_PRECISIONS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
               "float16": "float16", "fp32": "float32", "float32": "float32"}
_TEXT_ONLY = ("the fleet's workers serve token IDs in and token IDs out; text, chat templates "
              "and parsing stay with the trainer's tokenizer")
_UNOFFERED_WORKER_ARGS = {
    "tool_call_parser": f"tool-call parsing is not offered: {_TEXT_ONLY}",
    "reasoning_parser": f"reasoning parsing is not offered: {_TEXT_ONLY}",
    "custom_jinja_template": f"chat templates are not offered: {_TEXT_ONLY}",
}
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
class CollectiveSenderSpec:
    """NeMo-RL's sender spec fields (``nemo_rl.models.generation.interfaces``)."""

    nccl_peer: str = "nemo"
    buffer_size_bytes: int | None = None
    num_buffers: int | None = None


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
    on_gpu = cluster is not None and getattr(cluster, "use_gpus", True)  # NeMo-RL's are GPU ones
    fleet = {
        "model": _get(config, "model_name"), "served_model_name": _get(config, "model_name"),
        "engine": _engine(vllm, config.get("vllm_kwargs") or {}, on_gpu),
        "ranks_per_worker": ranks, "max_model_len": int(_get(vllm, "max_model_len", "vllm_cfg")),
        "max_new_tokens": int(_get(config, "max_new_tokens")),
        "stop_strings": list(config.get("stop_strings") or []),
        "env": _env_vars(vllm),
        "timeouts": {"start_s": float(_get(dynamo, "startup_timeout_s", "dynamo_cfg")),
                     "request_s": float(_get(dynamo, "request_timeout_s", "dynamo_cfg")),
                     "refit_s": float(_get(dynamo, "control_timeout_s", "dynamo_cfg"))},
    }
    router = (dynamo.get("frontend_args") or {}).get("router_mode")
    if router is not None:
        fleet["router"] = router
    extension = dict(config.get("rollout_fleet") or {})
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


class DynamoGeneration:
    """NeMo-RL's ``DynamoGeneration(cluster, config, tokenizer, tokenizer_config)``."""

    def __init__(self, cluster: Any, config: Mapping[str, Any], tokenizer: Any = None,
                 tokenizer_config: Mapping[str, Any] | None = None) -> None:
        self.cfg = dict(config)
        self.settings = read_nemo_rl_config(config, cluster)
        self.dp_openai_server_base_urls: list[str | None] = [None]
        self.refit_info: Any = None
        self._fleet: Fleet | None = Fleet.start(
            self.settings.fleet, placement_for(self.settings.fleet, _groups_of(cluster)))
        try:
            self.native = self._fleet.generation(**self.settings.generation)
            if self.native.config.metrics_interval_s > 0:
                self.native.prepare_for_generation()  # metrics are sampled from the start
        except BaseException:
            self._fleet.shutdown()
            raise

    # -- generation ---------------------------------------------------------------------------
    @property
    def frontend_url(self) -> str:
        """The OpenAI base URL of the fleet's frontend (``.../v1``), as NeMo-RL's."""
        return f"{self.native.frontend_url}/v1"

    def generate(self, data: Any, greedy: bool = False) -> Any:
        return self.native.generate(data, greedy)

    async def generate_async(self, data: Any, greedy: bool = False
                             ) -> AsyncIterator[tuple[int, Any]]:
        """Yield ``(sample_index, one-sample batch)`` as each finishes; outputs follow the
        input's integer dtype and device. An empty batch yields nothing."""
        if "vllm_content" in data:
            raise InvalidValue("vllm_content", "present", "multimodal prompts are not served: "
                               "this backend takes token-ID prompts only")
        input_ids = data["input_ids"]
        if input_ids.shape[0] == 0:
            return
        self._check_right_padding(input_ids, data["input_lengths"])
        async for index, sample in self.native.generate_async(data, greedy=greedy):
            yield index, _follow(sample, input_ids)

    def _check_right_padding(self, input_ids: Any, lengths: Any) -> None:
        pad = self.settings.pad_token_id
        if pad is None:
            return
        for row, (ids, length) in enumerate(zip(input_ids.tolist(), lengths.tolist())):
            tail = ids[int(length):]
            if any(token != pad for token in tail):
                raise InvalidValue(f"input_ids[{row}]", f"{tail[:8]} after input_lengths={length}",
                                   f"must be right-padded with _pad_token_id={pad}")

    # -- lifecycle ----------------------------------------------------------------------------
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return self.native.prepare_for_generation()

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return self.native.finish_generation()

    def invalidate_kv_cache(self) -> bool:
        return self.native.invalidate_kv_cache()

    def shutdown(self) -> bool:
        """Stop the driver and the fleet (frontend, workers, engines); safe to repeat. A pickled
        copy stops only its own connections."""
        fleet, self._fleet = self._fleet, None
        try:
            self.native.shutdown()
        finally:
            if fleet is not None:
                fleet.shutdown()
        return True

    # -- what NeMo-RL's interface asks about the backend ---------------------------------------
    @property
    def requires_kv_scale_sync(self) -> bool:
        return False

    def blocks_training(self) -> bool:
        return False  # the fleet runs on resources of its own

    def wake_carries_weight_updates(self) -> bool:
        return False  # new weights arrive by refit, never by waking

    def get_inference_world_size(self) -> int:
        return self.native.get_inference_world_size()

    def get_collective_sender_spec(self) -> CollectiveSenderSpec:
        spec = self.native.get_collective_sender_spec()
        return CollectiveSenderSpec(nccl_peer=spec.protocol, buffer_size_bytes=spec.buffer_bytes,
                                    num_buffers=spec.num_buffers)

    # -- metrics ------------------------------------------------------------------------------
    def get_logger_metrics(self) -> dict[str, dict[int, list[float]]]:
        """``{key: {worker ordinal: [value, ...]}}`` for NeMo-RL's four keys, sampled every
        ``vllm_metrics_logger_interval`` since the start (when the logger is enabled)."""
        timelines = self.native.get_logger_metrics()
        ordinals = self._ordinals()
        return {key: {ordinals[worker]: [value for _at, value in points]
                      for worker, points in timelines[native].items() if worker in ordinals}
                for key, native in LOGGER_METRICS.items()}

    def _ordinals(self) -> dict[str, int]:
        """Worker id -> its ordinal, fixed at first sight: a lost worker keeps its own (its
        samples until then stay reported under it) and one that joins takes the next."""
        known = self.__dict__.setdefault("_worker_ordinals", {})
        for worker in self.native.worker_ids:
            known.setdefault(worker, len(known))
        for per_worker in self.native.get_logger_metrics().values():
            for worker in per_worker:
                known.setdefault(worker, len(known))
        return known

    def clear_logger_metrics(self) -> None:
        self.native.clear_logger_metrics()

    # -- refit --------------------------------------------------------------------------------
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list:
        return self.native.init_collective(ip, port, world_size, train_world_size=train_world_size)

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any]) -> None:
        """NeMo-RL's ``{name: (shape, dtype)}``; the wire layout it makes is kept in
        ``refit_info`` (for a sender of the project's packed protocol)."""
        self.refit_info = self.native.prepare_refit_info(state_dict_info)

    def update_weights_from_collective(self) -> list:
        return self.native.update_weights_from_collective()

    def update_weights_via_ipc_zmq(self) -> list:
        return self.native.update_weights_via_ipc_zmq()

    def prepare_nccl_reshard_refit_info(self, refit_info: dict) -> None:
        raise NotImplementedError("nccl_reshard refit is not offered: use init_collective + "
                                  "update_weights_from_collective")

    def nccl_reshard_refit(self) -> list:
        raise NotImplementedError("nccl_reshard refit is not offered: use init_collective + "
                                  "update_weights_from_collective")

    def attach_fleet_health(self, monitor: Any, selector: Any) -> None:
        raise NotImplementedError("fleet health is not offered by this backend: its fleet "
                                  "retries transient failures itself")

    # -- pickling (NeMo-RL ships the generation object to its rollout actors) -----------------
    def __getstate__(self) -> dict[str, Any]:
        """A copy generates and invalidates caches through the same fleet; it owns nothing, and
        its ``shutdown`` releases only its own connections."""
        return {"cfg": self.cfg, "settings": self.settings, "native": self.native,
                "dp_openai_server_base_urls": self.dp_openai_server_base_urls}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.refit_info = None
        self._fleet = None

    def __repr__(self) -> str:
        state = "stopped" if self._fleet is None else "running"
        return f"DynamoGeneration(NeMo-RL drop-in, {state}, {self.native!r})"


def _follow(sample: Mapping[str, Any], input_ids: Any) -> Any:
    """The sample's tensors on the input's device; output_ids in the input's dtype."""
    out = {key: tensor.to(device=input_ids.device) for key, tensor in sample.items()}
    out["output_ids"] = out["output_ids"].to(dtype=input_ids.dtype)
    try:
        return type(sample)(out)
    except Exception:  # a mapping type that cannot be rebuilt from a dict
        return out


def _engine(vllm: Mapping[str, Any], vllm_kwargs: Mapping[str, Any], on_gpu: bool
            ) -> dict[str, Any]:
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
    if on_gpu:  # what NeMo-RL's trainer sends: vLLM's own packed NCCL broadcast
        engine.update(device="cuda", refit_protocol=VLLM_PROTOCOL)
    for key in ("gpu_memory_utilization", "enforce_eager"):
        if vllm.get(key) is not None:
            engine[key] = vllm[key]
    extra = dict(vllm_kwargs)
    extra.update(_passed_to_vllm(vllm, tensor))
    if "max_num_seqs" in extra:
        engine["max_num_seqs"] = int(extra.pop("max_num_seqs"))
    if "seed" in extra:  # the base: worker i's engine samples with seed + i
        engine["seed"] = int(extra.pop("seed"))
    if extra:
        engine["extra_engine_args"] = extra
    return engine


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
    if vllm.get("expose_http_server"):
        raise InvalidValue(f"{PREFIX}.vllm_cfg.expose_http_server", True,
                           "not offered: NeMo-Gym's clients reach the fleet's own OpenAI "
                           "frontend at frontend_url, which serves token IDs only")
    if (config.get("colocated") or {}).get("enabled"):
        raise InvalidValue(f"{PREFIX}.colocated.enabled", True,
                           "a Dynamo fleet runs on resources of its own")
    if config.get("refit_transport") is not None:
        raise InvalidValue(f"{PREFIX}.refit_transport", config["refit_transport"],
                           "must be null: this backend refits over the collective only")
    worker_args = dynamo.get("worker_args") or {}
    for key, why in _UNOFFERED_WORKER_ARGS.items():
        if worker_args.get(key) is not None:
            raise InvalidValue(f"{PREFIX}.dynamo_cfg.worker_args.{key}", worker_args[key], why)
    for key in ("extra_cli_args",):
        for section, args in (("worker_args", worker_args),
                              ("frontend_args", dynamo.get("frontend_args") or {})):
            if args.get(key):
                raise InvalidValue(f"{PREFIX}.dynamo_cfg.{section}.{key}", args[key],
                                   "not offered: the fleet builds its workers' and frontend's "
                                   "arguments itself; use the rollout_fleet section")


def _groups_of(cluster: Any) -> list:
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
