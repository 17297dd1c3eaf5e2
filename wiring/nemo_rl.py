"""NeMo-RL's ``DynamoGeneration``, as a drop-in: the constructor, config dict, methods and output
shapes of NeMo-RL's generation interface for its Dynamo backend, over a fleet this object builds,
owns, and stops at ``shutdown()``.

    generation = DynamoGeneration(cluster, config["policy"]["generation"])   # as NeMo-RL does

Underneath, the project's own pieces: the config dict becomes a ``FleetConfig`` (``Fleet``
starts it) and a ``GenerationConfig`` for the native driver
(``rollout_fleet.adapters.nemo_rl.FleetGeneration``, reachable as ``.native``).

docs/running-a-fleet.md ("NeMo-RL: a drop-in DynamoGeneration") lists every key and what it
becomes: each is passed on or refused by name. Workers go into the placement groups of the
``cluster`` (one bundle per engine rank); without them, the worker count comes from its
``world_size()``; with no cluster, one CPU worker runs on this machine. An optional
``rollout_fleet`` section holds ``FleetConfig`` fields that NeMo-RL has no key for.

Every method and member of NeMo-RL's newest ``GenerationInterface`` and of the handle its
controller drives is here: token capture and the checkpoint hooks over the fleet's door
(``nemo_rl_capture.py``), ``nccl_reshard_refit`` over the many-source sharded refit
(``adapters/nemo_rl/reshard.py``), the disk refit, ``load_and_start`` and the
``weight_synchronizer`` NeMo-RL attaches. What the fleet does its own way (shard restarts and
fleet health: it replaces lost workers and retries itself) is refused as NeMo-RL's interface
refuses it, with NotImplementedError naming this class.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

from rollout_fleet.adapters.nemo_rl.reshard import ReshardPlan, reshard_plan
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import RefitProtocol
from rollout_fleet.wiring.fleet import Fleet, placement_for
from rollout_fleet.wiring.nemo_rl_capture import DoorHooks, FleetDoor, sampling_profiles
from rollout_fleet.wiring.nemo_rl_config import (  # noqa: F401 - read_nemo_rl_config: public here
    DropInSettings,
    groups_of,
    read_nemo_rl_config,
)

if TYPE_CHECKING:
    from rollout_fleet.adapters.nemo_rl import FleetGeneration

# NeMo-RL's logger keys -> the native driver's timelines.
LOGGER_METRICS = {"inflight_batch_sizes": "inflight_requests",
                  "num_pending_samples": "pending_requests",
                  "kv_cache_usage_perc": "kv_cache_usage",
                  "generation_tokens": "generated_tokens"}


@dataclasses.dataclass(frozen=True)
class NemoRlSenderSpec:
    """The sender spec as NeMo-RL reads it (its ``CollectiveSenderSpec`` fields, from
    ``nemo_rl.models.generation.interfaces``): the core's ``CollectiveSenderSpec`` in NeMo-RL's
    names, the protocol as ``nccl_peer``."""

    nccl_peer: str = "nemo"
    buffer_size_bytes: int | None = None
    num_buffers: int | None = None


P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Delegated(Generic[T, P, R]):
    """A call of NeMo-RL's interface that one part of the drop-in answers as it is: read off
    the drop-in, it is that part's own method (same arguments, same answer)."""

    def __init__(self, part: Callable[["DynamoGeneration"], T],
                 method: Callable[[T], Callable[P, R]]) -> None:
        self._part = part
        self._method = method

    @overload
    def __get__(self, generation: None, owner: type) -> "Delegated[T, P, R]": ...
    @overload
    def __get__(self, generation: "DynamoGeneration", owner: type | None = None
                ) -> Callable[P, R]: ...

    def __get__(self, generation: "DynamoGeneration | None",
                owner: type | None = None) -> "Delegated[T, P, R] | Callable[P, R]":
        return self if generation is None else self._method(self._part(generation))


class AsNative(Delegated["FleetGeneration", P, R]):
    """Answered by the native driver (``FleetGeneration``)."""

    def __init__(self, method: Callable[["FleetGeneration"], Callable[P, R]]) -> None:
        super().__init__(lambda generation: generation.native, method)


class ViaDoor(Delegated[DoorHooks, P, R]):
    """Answered over the fleet's door (``DoorHooks``)."""

    def __init__(self, method: Callable[[DoorHooks], Callable[P, R]]) -> None:
        super().__init__(lambda generation: generation.hooks, method)


class DynamoGeneration:
    """NeMo-RL's ``DynamoGeneration(cluster, config, tokenizer, tokenizer_config)``."""

    @classmethod
    def validate_settings(cls, master_config: Any) -> None:
        """Refuse a ``policy.generation`` this backend cannot honour before anything is built:
        the same checks as the constructor's, no fleet started."""
        policy = master_config["policy"] if isinstance(master_config, Mapping) else master_config.policy
        read_nemo_rl_config(policy["generation"], None)

    def __init__(self, cluster: Any, config: Mapping[str, Any], tokenizer: Any = None,
                 tokenizer_config: Mapping[str, Any] | None = None) -> None:
        self.cfg = dict(config)
        self.settings = read_nemo_rl_config(config, cluster)
        profiles = sampling_profiles(self.cfg)
        self.dp_openai_server_base_urls: list[str | None] = [None]
        self.refit_info: Any = None
        self.reshard: ReshardPlan | None = None
        self.weight_synchronizer: Any = None  # NeMo-RL's, attached by its setup
        self._fleet: Fleet | None = Fleet.start(
            self.settings.fleet, placement_for(self.settings.fleet, groups_of(cluster)))
        self._door: FleetDoor | None = FleetDoor(self._fleet)
        try:
            self.native = self._fleet.generation(**self.settings.generation)
            self.hooks = DoorHooks(self.native, profiles, self._door.processes,
                                   type(self).__name__)
            if self.native.config.metrics_interval_s > 0:
                self.native.prepare_for_generation()  # metrics are sampled from the start
            door = self._door.running_url()
            if door is None and (self.cfg.get("vllm_cfg") or {}).get("expose_http_server"):
                door = self.hooks.url  # NeMo-Gym's OpenAI server: a door for this fleet
            if door is not None:  # the fleet's one URL, token-exact across turns
                self.dp_openai_server_base_urls = [f"{door}/v1"]
        except BaseException:
            self._door.stop()
            self._fleet.shutdown()
            raise

    # -- generation ---------------------------------------------------------------------------
    @property
    def frontend_url(self) -> str:
        """The fleet's OpenAI base URL (``.../v1``), as NeMo-RL's: its door where it has one,
        else its frontend."""
        door = self.dp_openai_server_base_urls[0]
        return door if door is not None else f"{self.native.frontend_url}/v1"

    def load_and_start(self) -> None:
        """NeMo-RL's deferred start: the fleet started serving in the constructor, so this
        checks that it still serves: every worker answers its weight version, and the door,
        where there is one, its health (a stopped drop-in or a pickled copy raises)."""
        if self._fleet is None:
            raise RuntimeError(f"{type(self).__name__}: this object owns no running fleet "
                               "(shut down, or a pickled copy)")
        self.native.get_weight_versions()
        door = self.dp_openai_server_base_urls[0]
        if door is not None:
            with urllib.request.urlopen(f"{door.removesuffix('/v1')}/health", timeout=30):
                pass

    generate = AsNative(lambda native: native.generate)

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
        """Wakes the colocated workers (NeMo-RL's ``tags``: weights, kv_cache)."""
        return self.native.prepare_for_generation(tags=kwargs.get("tags"))

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Sleeps the colocated workers (unless NeMo-RL's ``release_gpu=False``)."""
        return self.native.finish_generation(release_gpu=kwargs.get("release_gpu", True))

    invalidate_kv_cache = AsNative(lambda native: native.invalidate_kv_cache)

    def shutdown(self) -> bool:
        """Stop the driver and the fleet (frontend, workers, engines); safe to repeat. A pickled
        copy stops only its own connections."""
        fleet, self._fleet = self._fleet, None
        door, self._door = self._door, None
        try:
            if door is not None:
                door.stop()
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

    get_inference_world_size = AsNative(lambda native: native.get_inference_world_size)

    def get_collective_sender_spec(self) -> NemoRlSenderSpec:
        spec = self.native.get_collective_sender_spec()
        return NemoRlSenderSpec(nccl_peer=spec.protocol.value, buffer_size_bytes=spec.buffer_bytes,
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

    clear_logger_metrics = AsNative(lambda native: native.clear_logger_metrics)

    def drain_latest_logger_metrics(self) -> dict[str, dict[int, list[float]]]:
        """Each worker's newest sample per key (``generation_tokens``: its running count), in
        ``get_logger_metrics``' shape; every older sample is dropped."""
        latest = self.native.drain_latest_logger_metrics()
        ordinals = self._ordinals()
        return {key: {ordinals[worker]: [value for _at, value in points]
                      for worker, points in latest[native].items() if worker in ordinals}
                for key, native in LOGGER_METRICS.items()}

    snapshot_step_metrics = AsNative(lambda native: native.snapshot_step_metrics)

    get_step_metrics = AsNative(lambda native: native.get_step_metrics)

    # -- refit --------------------------------------------------------------------------------
    init_collective = AsNative(lambda native: native.init_collective)

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any]) -> None:
        """NeMo-RL's ``{name: (shape, dtype)}``; the wire layout it makes is kept in
        ``refit_info`` (for a sender of the project's packed protocol)."""
        self.refit_info = self.native.prepare_refit_info(state_dict_info)

    update_weights_from_collective = AsNative(lambda native: native.update_weights_from_collective)
    reload_weights = AsNative(lambda native: native.reload_weights)
    get_refit_payload_mode = AsNative(lambda native: native.get_refit_payload_mode)
    pause_generation_for_refit = AsNative(lambda native: native.pause_generation_for_refit)
    resume_generation_after_refit = AsNative(lambda native: native.resume_generation_after_refit)
    pause_generation = AsNative(lambda native: native.pause_generation)
    continue_generation = AsNative(lambda native: native.continue_generation)
    update_weights_via_ipc_zmq = AsNative(lambda native: native.update_weights_via_ipc_zmq)

    @property
    def dp_size(self) -> int:
        """Engines that each hold a whole model: one per worker, one IPC answer from each."""
        return len(self.native.worker_ids)

    def refit_reconstructs_all_runtime_weights(self, timeout_s: float | None = None) -> bool:
        """True once a refit has loaded every worker (the same version above 0): a worker
        takes only refits that carry every parameter, so a refit rebuilds all it serves."""
        versions = set(self.native.get_weight_versions().values())
        return len(versions) == 1 and min(versions) > 0

    def prepare_nccl_reshard_refit_info(self, refit_info: dict) -> None:
        """NeMo-RL's reshard refit info (``layer_names``, ``per_layer_params``,
        ``misc_meta``) as the fleet's many-source sharded refit: every worker checks the
        tensors it names; ``reshard`` keeps the refit info and trainer layout every trainer
        rank sends with (``ShardedTrainerSession.send_shards``). The fleet's engines must run
        the sharded protocol (``rollout_fleet.engine.refit_protocol``)."""
        protocol = self.native.get_collective_sender_spec().protocol
        if protocol is not RefitProtocol.SHARDED:
            raise NotImplementedError(
                f"nccl_reshard refit is not supported for {type(self).__name__} whose engines "
                f"refit over {protocol.value!r}: set rollout_fleet.engine.refit_protocol = "
                f"{RefitProtocol.SHARDED.value!r}")
        plan = reshard_plan(refit_info, inference_world_size=self.get_inference_world_size(),
                            tensor_parallel_size=int(self.settings.fleet.engine.get(
                                "tensor_parallel_size", 1)))
        self.refit_info = self.native.prepare_refit_info(plan.state_dict_info)
        self.reshard = plan

    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> list:
        """Every worker receives its slices from every trainer rank at once; one future per
        worker (the trainer ranks send meanwhile). Past ``refit_timeout_s`` each worker
        abandons the refit and keeps its weights."""
        if self.reshard is None or self.refit_info != self.reshard.info:
            raise RefitError("nccl_reshard_refit before prepare_nccl_reshard_refit_info (or "
                             "after another refit info replaced it)")
        return self.native.update_weights_from_collective(refit_timeout_s)

    # -- the fleet's door: token capture, the checkpoint's generation fence --------------------
    setup_token_capture = ViaDoor(lambda hooks: hooks.setup_token_capture)
    set_rollout_weight_version = ViaDoor(lambda hooks: hooks.set_rollout_weight_version)
    pause_generation_for_checkpoint = ViaDoor(
        lambda hooks: hooks.pause_generation_for_checkpoint)
    resume_generation_after_cut = ViaDoor(lambda hooks: hooks.resume_generation_after_cut)
    finish_generation_checkpoint = ViaDoor(lambda hooks: hooks.finish_generation_checkpoint)
    resume_generation_after_checkpoint = ViaDoor(
        lambda hooks: hooks.resume_generation_after_checkpoint)

    # -- what the fleet does its own way: refused as NeMo-RL's interface refuses it ------------
    def attach_fleet_health(self, monitor: Any, selector: Any) -> None:
        raise NotImplementedError(
            "async_rl.generation_fleet_health.enabled=true is not supported for the "
            f"{type(self).__name__} generation backend: its fleet routes around lost workers, "
            "retries their rollouts and replaces them itself")

    def restart_shard(self, shard_idx: int) -> str | None:
        raise NotImplementedError(f"restart_shard is not supported for {type(self).__name__}: "
                                  "its fleet replaces a lost worker itself")

    def shard_liveness_ref(self, shard_idx: int) -> Any:
        raise NotImplementedError(f"shard_liveness_ref is not supported for "
                                  f"{type(self).__name__}: its fleet watches its workers itself")

    def log_shard_gpu_state(self, shard_idx: int, *, label: str, timeout_s: float = 30.0) -> None:
        """Nothing to log (NeMo-RL's default): the fleet's workers log their own devices."""

    # -- pickling (NeMo-RL ships the generation object to its rollout actors) -----------------
    def __getstate__(self) -> dict[str, Any]:
        """A copy generates and invalidates caches through the same fleet; it owns nothing, and
        its ``shutdown`` releases only its own connections."""
        return {"cfg": self.cfg, "settings": self.settings, "native": self.native,
                "dp_openai_server_base_urls": self.dp_openai_server_base_urls,
                "door": self.hooks.copy_state()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        door = state.pop("door")
        self.__dict__.update(state)
        self.refit_info = self.reshard = self.weight_synchronizer = None
        self._fleet = None
        self._door = None  # the door's processes stay with the object that started them
        self.hooks = DoorHooks(self.native, door["profiles"], None, type(self).__name__,
                               door["controls"])

    def __repr__(self) -> str:
        state = "stopped" if self._fleet is None else "running"
        return f"DynamoGeneration(NeMo-RL drop-in, {state}, {self.native!r})"

def _follow(sample: Any, input_ids: Any) -> Any:
    """The sample's tensors on the input's device; output_ids in the input's dtype. ``sample``:
    the native driver's one-sample batch (a mapping of tensors, of a type that may or may not
    be built from a dict)."""
    out = {key: tensor.to(device=input_ids.device) for key, tensor in sample.items()}
    out["output_ids"] = out["output_ids"].to(dtype=input_ids.dtype)
    try:
        return type(sample)(out)
    except Exception:  # a mapping type that cannot be rebuilt from a dict
        return out
