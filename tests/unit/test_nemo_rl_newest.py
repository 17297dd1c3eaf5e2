"""The drop-in against NeMo-RL's newest generation interface, without a fleet: every method the
interface declares is there with the parameters NeMo-RL passes (``refit_timeout_s`` on both
collective refits, keyword-only ``timeout_s`` on the four checkpoint hooks), what the fleet
does its own way is refused with NotImplementedError naming the class (as NeMo-RL's tests
expect of a backend that refuses), the checkpoint hooks reach the fleet's hold and the door's
fence in NeMo-RL's order (a fence that did not drain is a TimeoutError), token capture's setup
carries the config's sampling profiles, and NeMo-RL's reshard refit info becomes the sharded
refit's tensors and trainer layout (what cannot be is refused by its field). The interface
restated here: ``nemo_rl/models/generation/interfaces.py`` at 604eb06e (token capture) and the
branch version with the checkpoint hooks; ``nemo_rl/weight_sync/nccl_reshard_utils.py``
(build_nccl_reshard_refit_info and its wire-safe form)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from rollout_fleet.adapters.nemo_rl import FleetGeneration
from rollout_fleet.adapters.nemo_rl.reshard import reshard_plan
from rollout_fleet.core.errors import InvalidValue, RefitError
from rollout_fleet.core.refit import CollectiveSenderSpec, RefitInfo, RefitProtocol
from rollout_fleet.core.sampling_guard import SamplingProfiles
from rollout_fleet.wiring.door_control_client import DoorControlError
from rollout_fleet.wiring.nemo_rl import DynamoGeneration
from rollout_fleet.wiring.nemo_rl_capture import DoorHooks, sampling_profiles

# NeMo-RL's interface: name -> the parameters it is called with (keyword-only after "*").
INTERFACE = {
    "init_collective": "ip port world_size * train_world_size",
    "generate": "data greedy", "prepare_for_generation": "", "finish_generation": "",
    "shutdown": "", "pause_generation": "mode", "continue_generation": "",
    "restart_shard": "shard_idx", "shard_liveness_ref": "shard_idx",
    "log_shard_gpu_state": "shard_idx * label timeout_s",
    "prepare_refit_info": "state_dict_info", "update_weights_via_ipc_zmq": "",
    "update_weights_from_collective": "refit_timeout_s",
    "get_collective_sender_spec": "", "get_inference_world_size": "",
    "get_refit_payload_mode": "", "prepare_nccl_reshard_refit_info": "refit_info",
    "nccl_reshard_refit": "refit_timeout_s", "attach_fleet_health": "monitor selector",
    "setup_token_capture": "dp_cfg staging_partition * capture_media",
    "set_rollout_weight_version": "version", "invalidate_kv_cache": "",
    "pause_generation_for_refit": "* clear_cache", "resume_generation_after_refit": "",
    "pause_generation_for_checkpoint": "* timeout_s",
    "resume_generation_after_checkpoint": "* timeout_s",
    "resume_generation_after_cut": "* timeout_s", "finish_generation_checkpoint": "* timeout_s",
    "blocks_training": "", "wake_carries_weight_updates": "", "clear_logger_metrics": "",
    "get_logger_metrics": "", "snapshot_step_metrics": "", "get_step_metrics": "",
    "drain_latest_logger_metrics": "",
    # the controller's handle (tests/mock_stack/runtime.py GenerationHandle) beyond those
    "load_and_start": "", "reload_weights": "weights_path", "generate_async": "data greedy",
}


class Native:
    """The native driver as the drop-in's hooks call it, recording each call."""

    def __init__(self, protocol=RefitProtocol.PACKED) -> None:
        self.calls: list = []
        self.spec = CollectiveSenderSpec(protocol=protocol)

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "prepare_refit_info":
                return RefitInfo.from_state_dict_info(args[0])
            return {"get_collective_sender_spec": self.spec, "get_inference_world_size": 2,
                    "update_weights_from_collective": ["future"]}.get(name)
        return call


class Controls:
    door_url = "http://door"

    def __init__(self, calls: list, refuse: int | None = None) -> None:
        self.calls, self.refuse = calls, refuse

    def setup_token_capture(self, *args, **kwargs):
        self.calls.append(("setup_token_capture", args, kwargs))

    def set_rollout_weight_version(self, version):
        self.calls.append(("set_rollout_weight_version", (version,), {}))

    def fence(self, name, timeout_s=None):
        self.calls.append((name, (), {"timeout_s": timeout_s}))
        if self.refuse:
            raise DoorControlError(name, self.refuse, "did not drain", None)


def bare(native=None, refuse=None, tensor_parallel_size=1) -> DynamoGeneration:
    """A drop-in as its methods see it, with no fleet behind it."""
    generation = object.__new__(DynamoGeneration)
    generation.native = native if native is not None else Native()
    generation.settings = SimpleNamespace(fleet=SimpleNamespace(
        engine={"tensor_parallel_size": tensor_parallel_size}))
    generation.refit_info = generation.reshard = None
    controls = Controls(getattr(generation.native, "calls", []), refuse)
    generation.hooks = DoorHooks(generation.native, SamplingProfiles.from_wire(
        {"temperature": 1.0, "top_p": 1.0}), None, "DynamoGeneration", controls)
    return generation


def parameters(method) -> tuple[str, list[str]]:
    """The parameters' names ("*" before the keyword-only ones), and those without defaults."""
    words, required = [], []
    for parameter in inspect.signature(method).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.kind is parameter.KEYWORD_ONLY and "*" not in words:
            words.append("*")
        words.append(parameter.name)
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    return " ".join(words), required


@pytest.mark.parametrize("name", sorted(INTERFACE))
def test_every_method_of_the_interface_takes_what_nemo_rl_passes(name):
    method = getattr(bare(object.__new__(FleetGeneration)), name)  # the native driver's own
    declared, required = parameters(method)
    expected = INTERFACE[name]
    assert declared.startswith(expected), (name, declared)
    assert set(required) <= set(expected.split()), (name, required)  # any more: optional


def test_the_members_the_controller_reads_are_there():
    generation = bare()
    generation.weight_synchronizer = None
    generation.dp_openai_server_base_urls = ["http://door/v1"]
    assert generation.requires_kv_scale_sync is False
    assert DynamoGeneration.validate_settings.__self__ is DynamoGeneration  # a classmethod


@pytest.mark.parametrize("call", [
    lambda g: g.attach_fleet_health(object(), object()),
    lambda g: g.restart_shard(0),
    lambda g: g.shard_liveness_ref(0),
    lambda g: g.setup_token_capture({}, "staging", capture_media=True),
    lambda g: g.prepare_nccl_reshard_refit_info({"train_world_size": 1}),
])
def test_what_the_fleet_does_its_own_way_is_refused_naming_the_class(call):
    with pytest.raises(NotImplementedError, match="DynamoGeneration"):
        call(bare())


def test_the_checkpoint_hooks_reach_the_hold_and_the_fence_in_order():
    generation = bare()
    assert generation.pause_generation_for_checkpoint(timeout_s=5) is True
    assert generation.resume_generation_after_cut() is True
    assert generation.finish_generation_checkpoint(timeout_s=1.5) is True
    assert generation.resume_generation_after_checkpoint() is True
    assert [(name, args, kwargs) for name, args, kwargs in generation.native.calls] == [
        ("pause_generation", ("in_place",), {}),
        ("pause_generation_for_checkpoint", (), {"timeout_s": 5}),
        ("resume_generation_after_cut", (), {"timeout_s": None}),
        ("continue_generation", (), {}),
        ("finish_generation_checkpoint", (), {"timeout_s": 1.5}),
        ("resume_generation_after_checkpoint", (), {"timeout_s": None}),
        ("continue_generation", (), {})]
    with pytest.raises(TimeoutError, match="DynamoGeneration.pause_generation_for_checkpoint"):
        bare(refuse=504).pause_generation_for_checkpoint(timeout_s=0.1)
    with pytest.raises(DoorControlError):
        bare(refuse=401).finish_generation_checkpoint()


def test_token_capture_carries_the_configs_sampling_profiles():
    generation = bare()
    generation.setup_token_capture({"impl": "transfer_queue"}, "staging",
                                   generation_prefix_cuts_enabled=True,
                                   generation_cut_control_token="bearer")
    generation.set_rollout_weight_version(7)
    (setup, args, kwargs), version = generation.native.calls
    assert (setup, args) == ("setup_token_capture", ({"impl": "transfer_queue"}, "staging"))
    assert kwargs["generation_prefix_cuts_enabled"] and kwargs["generation_cut_control_token"]
    assert version == ("set_rollout_weight_version", (7,), {})
    profiles = sampling_profiles({"temperature": 1.0, "top_p": 0.9, "val_temperature": 0.0,
                                  "val_top_p": None})
    assert profiles.to_wire() == {"temperature": 1.0, "top_p": 0.9, "val_temperature": 0.0,
                                  "val_top_p": 0.9}


def mesh(ranks):
    return {"mesh": ranks}


def bulk(name, shape, placements, ranks=(0, 1)):
    return {"name": name, "global_shape": shape, "dtype": "torch.float32",
            "src_mesh_info": mesh(list(ranks)), "src_placements": placements,
            "dst_mesh_info": mesh([2, 3]), "dst_placements": [{}]}


def reshard_info(**changes):
    """NeMo-RL's reshard refit info in its wire-safe form: 2 trainer ranks, 2 engine ranks."""
    info = {"layer_names": ["model.layers.0"],
            "per_layer_params": {"model.layers.0": [
                bulk("model.layers.0.mlp.up_proj.weight", (5, 4), [{"dim": 0}]),
                bulk("model.layers.0.mlp.gate_proj.weight", (4, 4), [{}])]},
            "misc_meta": {"model.norm.weight": {"shape": [4], "dtype": "torch.float32"}},
            "train_world_size": 2, "gen_world_size": 2, "pp_size": 1, "gen_tp_size": 1}
    return {**info, **changes}


def test_a_reshard_info_becomes_the_sharded_refits_tensors_and_trainer_layout():
    plan = reshard_plan(reshard_info(), inference_world_size=2, tensor_parallel_size=1)
    assert plan.state_dict_info == {"model.layers.0.mlp.up_proj.weight": ((5, 4), "float32"),
                                    "model.layers.0.mlp.gate_proj.weight": ((4, 4), "float32"),
                                    "model.norm.weight": ((4,), "float32")}
    assert plan.layout.train_world_size == 2
    assert plan.layout.rows == ((3, 2), None, None)  # torch.chunk's cut of Shard(0); whole


def test_placements_as_torch_objects_read_the_same():
    from torch.distributed.tensor import Replicate, Shard

    info = reshard_info(per_layer_params={"model.layers.0": [
        bulk("model.layers.0.mlp.up_proj.weight", (5, 4), [Shard(0)]),
        bulk("model.layers.0.mlp.gate_proj.weight", (4, 4), [Replicate()])]})
    plan = reshard_plan(info, inference_world_size=2, tensor_parallel_size=1)
    assert plan.layout.rows == ((3, 2), None, None)


@pytest.mark.parametrize("changes, field", [
    ({"per_layer_params": {"model.layers.0": [
        bulk("model.layers.0.mlp.down_proj.weight", (4, 6), [{"dim": 1}])]}},
     "model.layers.0.mlp.down_proj.weight.src_placements"),
    ({"per_layer_params": {"model.layers.0": [
        bulk("model.layers.0.mlp.up_proj.weight", (4, 4), [{}, {"dim": 0}], ranks=[[0], [1]])]}},
     "model.layers.0.mlp.up_proj.weight.src_placements"),
    ({"per_layer_params": {"model.layers.0": [
        {**bulk("model.layers.0.mlp.experts.up_proj.weight", (2, 4, 4), [{"dim": 0}]),
         "grouped_expert_proj": "up_proj"}]}},
     "model.layers.0.mlp.experts.up_proj.weight.grouped_expert_proj"),
    ({"gen_world_size": 4}, "gen_world_size"),
    ({"gen_tp_size": 2}, "gen_tp_size"),
    ({"pp_size": 2}, "pp_size"),
    ({"train_world_size": 0}, "train_world_size"),
])
def test_what_the_sharded_refit_cannot_take_is_refused_by_its_field(changes, field):
    with pytest.raises(InvalidValue) as refused:
        reshard_plan(reshard_info(**changes), inference_world_size=2, tensor_parallel_size=1)
    assert refused.value.field == field


def test_the_reshard_refit_runs_the_sharded_refit_of_the_prepared_info():
    generation = bare(Native(RefitProtocol.SHARDED))
    with pytest.raises(RefitError, match="before prepare_nccl_reshard_refit_info"):
        generation.nccl_reshard_refit()
    generation.prepare_nccl_reshard_refit_info(reshard_info())
    assert generation.nccl_reshard_refit(refit_timeout_s=30) == ["future"]
    calls = [(name, args) for name, args, _kwargs in generation.native.calls]
    assert calls[-2:] == [("prepare_refit_info", (generation.reshard.state_dict_info,)),
                          ("update_weights_from_collective", (30,))]
