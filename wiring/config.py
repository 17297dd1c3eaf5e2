"""The fleet's configuration: one file (TOML or JSON), checked strictly with pydantic.

Unknown keys, impossible sizes and ports already in use are refused with one clear line that
names the field and the value.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from rollout_fleet.adapters.dynamo.env import check_bind_host
from rollout_fleet.adapters.shared import is_loopback
from rollout_fleet.core.device import Device
from rollout_fleet.core.budget import DEFAULT_ATTEMPT_FIXED_S, DEFAULT_ATTEMPT_PER_TOKEN_S
from rollout_fleet.core.control_relay import DEFAULT_RELAY_WIDTH, check_relay_width
from rollout_fleet.core.errors import InvalidValue, RolloutFleetError, shown
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitFanout, RefitProtocol
from rollout_fleet.core.retry import RetryPolicy
from rollout_fleet.core.rollout_client import DEFAULT_MAX_IN_FLIGHT
from rollout_fleet.ports.engine_kind import FleetFacts
from rollout_fleet.ports.placement import PlacementKind
from rollout_fleet.wiring.colocation import ColocationConfig
from rollout_fleet.wiring.door_config import DoorSection
from rollout_fleet.wiring.engines import EngineChoice


# Every --router-mode Dynamo 1.6.1's frontend accepts ("direct" is refused: see FleetConfig).
RouterMode = Literal["round-robin", "random", "power-of-two", "kv", "direct", "least-loaded",
                     "device-aware-weighted"]
ROUTER_MODES: tuple[str, ...] = get_args(RouterMode)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A step of a healthy GPU engine takes well under a second; a loaded CPU one, seconds.
HANG_TIMEOUT_GPU_S = 30.0
HANG_TIMEOUT_CPU_S = 120.0


class ConfigError(RolloutFleetError, ValueError):
    """A config that cannot run: names the source, the field path and the value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_POLICY = RetryPolicy()  # the one place the retry defaults live (core/retry.py)


class RetrySection(_Strict):
    """The driver's ``RetryPolicy`` as the config file spells it: its defaults are the
    policy's own; the bounds are repeated here only so that a bad value is named by its
    config path before the policy is built."""
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # RetryPolicy needs finite
    max_attempts: int = Field(default=_POLICY.max_attempts, ge=1)
    base_delay_s: float = Field(default=_POLICY.base_delay_s, ge=0)
    backoff: float = Field(default=_POLICY.backoff, ge=1)
    max_delay_s: float = Field(default=_POLICY.max_delay_s, ge=0)
    jitter: float = Field(default=_POLICY.jitter, ge=0, le=1)

    def policy(self) -> RetryPolicy:
        return RetryPolicy(**self.model_dump())


class TimeoutSection(_Strict):
    start_s: float = Field(default=300.0, gt=0, description="until every worker is registered")
    connect_s: float = Field(default=10.0, gt=0)
    request_s: float = Field(default=600.0, gt=0, description="one rollout attempt, at most")
    attempt_fixed_s: float = Field(
        default=DEFAULT_ATTEMPT_FIXED_S, gt=0, description="one rollout attempt may take this plus "
        "attempt_per_token_s per token of its budget (never above request_s); past it the "
        "driver sends it again (a worker that hangs unseen costs that, not request_s)")
    attempt_per_token_s: float = Field(default=DEFAULT_ATTEMPT_PER_TOKEN_S, ge=0)
    hang_timeout_s: float | None = Field(
        default=None, gt=0, description="a worker whose engine completes no step for this long "
        "while it has rollouts in flight declares itself hung and leaves the fleet; None: "
        f"{HANG_TIMEOUT_GPU_S:g} s on GPUs, {HANG_TIMEOUT_CPU_S:g} s on CPUs")
    refit_s: float = Field(default=600.0, gt=0, description="each refit step on every worker")
    shutdown_s: float = Field(default=15.0, gt=0)


class RefitSection(_Strict):
    buffer_bytes: int = Field(default=1 << 30, ge=1)
    num_buffers: int = Field(default=2, ge=1)
    fanout: Literal["broadcast", "tree"] = Field(
        default="broadcast",
        description="how a gloo refit reaches every worker: broadcast (the trainer sends every "
        "byte to each worker) or tree (the workers relay each piece down two binary trees, so "
        "no process sends more than the refit's bytes; core/fanout.py). NCCL broadcasts")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        default="auto",
        description="what the refit group runs on; auto: NCCL on GPUs, gloo on CPUs. "
        "gloo on GPUs: a trainer that shares the workers' GPU (NCCL refuses two ranks on one GPU)")
    control_relay_width: int = Field(default=DEFAULT_RELAY_WIDTH, description="a refit step "
        "for more workers than this is relayed down a tree of them (core/control_relay.py); "
        "0: the driver calls every worker")

    @field_validator("control_relay_width")
    @classmethod
    def _relay_width(cls, width: int) -> int:
        return check_relay_width(width)

    def spec(self, protocol: RefitProtocol = RefitProtocol.PACKED) -> CollectiveSenderSpec:
        return CollectiveSenderSpec(protocol=protocol, buffer_bytes=self.buffer_bytes,
                                    num_buffers=self.num_buffers, fanout=RefitFanout(self.fanout))


class FleetConfig(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)
    model: str = Field(
        default="tiny", description='a model folder, a Hugging Face model id found in the local '
        'Hugging Face cache (offline), or "tiny" (built into the run folder)')
    served_model_name: str = "tiny"
    engine: dict[str, Any] = Field(default_factory=lambda: {"kind": "vllm"},
                                   description="engine kind and its options, given to each worker")
    num_workers: int = Field(default=2, ge=1, le=4096)
    ranks_per_worker: int = Field(default=1, ge=1, description="tensor x pipeline parallel ranks")
    device: Device = Device.CPU
    cpus_per_worker: float = Field(default=1.0, gt=0)
    placement: PlacementKind = Field(
        default=PlacementKind.RAY,
        description="ray: a placement group (one node or a cluster); local: child "
        "processes on this machine")
    env: dict[str, str] = Field(default_factory=dict,
                                description="extra DYN_* settings for the frontend and every worker")
    worker_start: Literal["fork", "exec"] = Field(
        default="exec", description="local placement: fork each worker from a process that has "
        "imported what every worker imports (fork), or start each as a new interpreter (exec)")
    discovery: Literal["file", "etcd"] = "file"
    router: RouterMode = Field(
        default="round-robin",
        description="how the frontend picks a worker (Dynamo's --router-mode): "
        "round-robin, random, power-of-two (the less busy of two random workers), least-loaded "
        "(the fewest active requests), device-aware-weighted (by device kind), kv (by cached "
        "prefix: vLLM workers publish KV events)")
    etcd_endpoint: str | None = Field(
        default=None, description="an etcd to use; None starts one on loopback")
    ray_address: str | None = Field(
        default=None, description="join this Ray cluster; None starts a local one")
    bind_host: str = Field(
        default="127.0.0.1",
        description="this (the driver's) node's address: the frontend, etcd and the "
        "trainer's end of the refit group listen there; with ray_address and an address on the "
        "cluster network, each worker binds its own node's cluster address")
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict, description="more Ray resources each worker reserves (custom "
        "resources pin workers to the nodes that offer them)")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK", description="how Ray spreads the workers' bundles over nodes")
    frontend_port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    run_dir: str | None = Field(
        default=None, description="logs, discovery, model copies; None: a temp folder")
    max_in_flight: int = Field(default=DEFAULT_MAX_IN_FLIGHT, ge=1,
                               description="rollouts in flight from one driver")
    max_new_tokens: int = Field(default=64, ge=1)
    max_model_len: int = Field(default=512, ge=2)
    stop_strings: list[str] = Field(default_factory=list, max_length=32)
    context_limit_policy: Literal["reject", "empty"] = "reject"
    replace_lost_workers: bool = Field(
        default=False, strict=True, description="start a replacement for each worker that is "
        "lost; it joins the refit group at the trainer's next init_collective and serves once "
        "the next update has loaded the current weights on it")
    retry: RetrySection = RetrySection()
    timeouts: TimeoutSection = TimeoutSection()
    refit: RefitSection = RefitSection()
    colocation: ColocationConfig = Field(
        default_factory=ColocationConfig, description="workers that share their devices with "
        "trainer ranks and sleep between generation phases (wiring/colocation.py)")
    door: DoorSection = DoorSection()
    chat: dict[str, Any] = Field(
        default_factory=dict, description="how each worker registers its model for chat: "
        "tool_call_parser and reasoning_parser (names Dynamo offers), custom_jinja_template "
        "(a template file used instead of the model's)")

    @field_validator("chat")
    @classmethod
    def _chat(cls, value: dict[str, Any]) -> dict[str, str]:
        from rollout_fleet.adapters.dynamo.chat import check_chat_settings

        try:
            return check_chat_settings(value, field_prefix="chat")
        except InvalidValue as exc:
            raise ValueError(f"{exc.field.removeprefix('chat.')}={_shown(exc.value)}: "
                             f"{exc.rule}") from None

    @field_validator("colocation", mode="before")
    @classmethod
    def _colocation(cls, value: Any) -> ColocationConfig:
        return ColocationConfig.from_mapping(value)

    @field_validator("model")
    @classmethod
    def _resolve_model(cls, value: str) -> str:
        return resolve_model(value)

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Device:
        try:
            return Device.parse(value, "device")
        except InvalidValue as exc:
            raise ValueError(exc.rule) from None

    @model_validator(mode="after")
    def _consistent(self) -> "FleetConfig":
        if self.router == "direct":
            raise ValueError("router='direct': Dynamo's direct mode sends each request to the "
                             "worker the request names, and this fleet's clients name none; "
                             "use round-robin, random, power-of-two, least-loaded, "
                             "device-aware-weighted or kv")
        if "kind" not in self.engine:
            raise ValueError("engine.kind is required (e.g. 'vllm' or 'memory')")
        self.colocated_workers  # refuses a trainer_ranks mapping the fleet cannot have
        if self.placement is PlacementKind.LOCAL and self.ray_address is not None:
            raise ValueError(f"ray_address={_shown(self.ray_address)}: a local placement uses no Ray")
        try:
            check_bind_host("bind_host", self.bind_host)
        except InvalidValue as exc:
            raise ValueError(f"bind_host={_shown(self.bind_host)}: {exc.rule}") from None
        if self.spans_nodes and self.discovery == "file":
            raise ValueError(
                f"discovery='file' with bind_host={_shown(self.bind_host)} and ray_address="
                f"{_shown(self.ray_address)}: a discovery folder is one machine's; a fleet "
                "across nodes needs discovery='etcd'")
        reserved = sorted(set(self.resources_per_worker) & {"CPU", "GPU"})
        if reserved:
            raise ValueError(f"resources_per_worker.{reserved[0]}: set it with cpus_per_worker, "
                             "device and ranks_per_worker")
        bad = {k: v for k, v in self.resources_per_worker.items() if not v > 0}
        if bad:
            name, value = next(iter(bad.items()))
            raise ValueError(f"resources_per_worker.{name}={_shown(value)}: must be > 0")
        if self.refit.backend == "nccl" and self.device is Device.CPU:
            raise ValueError("refit.backend='nccl' needs device='gpu'")
        if self.frontend_port and port_in_use(self.bind_host, self.frontend_port):
            raise ValueError(f"frontend_port={self.frontend_port} is already in use on {self.bind_host}")
        if self.door.processes and self.door.port:
            if self.door.port == self.frontend_port:
                raise ValueError(f"door.port={self.door.port}: frontend_port is the same port")
            if port_in_use(self.bind_host, self.door.port):
                raise ValueError(f"door.port={self.door.port} is already in use on {self.bind_host}")
        return self

    @functools.cached_property
    def engine_choice(self) -> EngineChoice:
        """The engine table parsed once by its kind (``parse_config`` does it first, so that a
        bad option is refused there)."""
        return EngineChoice.parse(self.engine, fleet_facts(self))

    @property
    def colocated_workers(self) -> dict[str, tuple[int, ...]]:
        """Worker name -> the trainer ranks on its devices (empty: no colocation)."""
        names = [f"worker-{i}" for i in range(self.num_workers)]
        return self.colocation.placement(names, self.ranks_per_worker)

    @property
    def hang_timeout_s(self) -> float:
        """How long a worker's engine may make no progress under load before it is hung."""
        if self.timeouts.hang_timeout_s is not None:
            return self.timeouts.hang_timeout_s
        return HANG_TIMEOUT_GPU_S if self.device is Device.GPU else HANG_TIMEOUT_CPU_S

    @property
    def sender_spec(self) -> CollectiveSenderSpec:
        """The refit geometry, in the protocol the workers' engines receive in."""
        return self.refit.spec(self.engine.get("refit_protocol", RefitProtocol.PACKED))

    @property
    def spans_nodes(self) -> bool:
        """Workers may run on other nodes of a Ray cluster: each binds its own node's address
        there (found by Ray on that node), discovery is etcd, and the driver's node serves
        the frontend, etcd and the trainer's end of the refit group on ``bind_host``. A fleet
        on loopback stays on this machine."""
        return self.placement is PlacementKind.RAY and self.ray_address is not None \
            and not is_loopback(self.bind_host)

    @property
    def bundle(self) -> dict[str, float]:
        extra = dict(self.resources_per_worker)
        if self.device is Device.GPU:
            return {"GPU": float(self.ranks_per_worker), "CPU": self.cpus_per_worker, **extra}
        return {"CPU": self.cpus_per_worker, **extra}


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def parse_config(data: Any, source: str = "config") -> FleetConfig:
    """The checked config: its fields, its engine's options and its model folder, before any
    process starts. ConfigError names the source, the field and the value."""
    try:
        config = FleetConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{source}: {_problems(exc)}") from None
    try:
        engine = config.engine_choice  # the engine table parsed, once
    except InvalidValue as exc:
        raise ConfigError(f"{source}: {exc.field}: {exc.rule} (got {_shown(exc.value)})") from None
    if engine.refit_ranks() != config.ranks_per_worker:
        raise ConfigError(
            f"{source}: ranks_per_worker={_shown(config.ranks_per_worker)} disagrees with the "
            f"engine's {engine.refit_ranks()} rank(s) (engine {engine.ranks_source()}): every "
            "engine rank joins the refit group, so the two must be equal")
    return config


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def fleet_facts(config: FleetConfig) -> FleetFacts:
    """What the config's engine kind may read of its fleet."""
    return FleetFacts(device=config.device, max_model_len=config.max_model_len,
                      num_workers=config.num_workers, kv_routing=config.router == "kv",
                      model=config.model, one_host=config.ray_address is None,
                      colocated=config.colocation.enabled)


def check_model_folder(field: str, folder: Any) -> None:
    """A Hugging Face style folder: a config.json and at least one weights file."""
    if not isinstance(folder, str) or not folder:
        raise InvalidValue(field, folder, "must be a model folder")
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise InvalidValue(field, folder, "is not a folder" if path.exists() else "does not exist")
    if not (path / "config.json").is_file():
        raise InvalidValue(field, folder, "holds no config.json: not a model folder")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise InvalidValue(field, folder, f"holds no weights ({', '.join(WEIGHT_FILES)})")


def resolve_model(model: str) -> str:
    """``model`` as given when it is "tiny" or an existing path; a Hugging Face model id
    (``org/name``) becomes the folder of its snapshot in the local Hugging Face cache, found
    offline (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub)."""
    if model == "tiny" or Path(model).expanduser().exists() or not _HUB_ID.match(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(model, local_files_only=True, cache_dir=hub_cache_dir())
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise ValueError(
            f"model={model!r} is neither a folder nor a model id in the local Hugging Face cache "
            f"({hub_cache_dir()}); nothing is downloaded: put it in the cache first "
            "(huggingface-cli download) or give a model folder") from None


def hub_cache_dir() -> str:
    """Where Hugging Face keeps downloaded models, read from the environment at each call."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def load_config(path: str | Path) -> FleetConfig:
    """Read a TOML (``.toml``) or JSON file; InvalidValue names the file and the bad field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidValue("--config", str(path), f"cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InvalidValue("--config", str(path), f"is not UTF-8 text: {exc.reason}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:  # deep nesting recurses
        raise InvalidValue("--config", str(path), f"is not valid {path.suffix or 'JSON'}: {exc}") from None
    return parse_config(data, source=str(path))


def _shown(value: Any) -> str:
    return shown(value, 80)  # never raises: huge ints and deep nesting have no repr


def _problems(exc: pydantic.ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "(top level)"
        value = error.get("input")
        got = "" if isinstance(value, dict) else f" (got {_shown(value)})"
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}{got}" if error["type"] != "extra_forbidden"
                        else f"{where}: unknown key")
    return "; ".join(problems)
