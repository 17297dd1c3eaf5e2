"""The closed sets of names (refit protocol, rollback, colocated step, placement): each is read
from its old spelling into its enum where it arrives, written back as that spelling, and a
bad one is refused naming the field, the value and the spellings allowed."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_fleet.adapters.vllm.inside.colocated_engine import ColocatedTransferEngine
from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig
from rollout_fleet.adapters.vllm.messages import PackedInitInfo
from rollout_fleet.core.colocated_refit import ColocatedStep
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin, RefitProtocol, RefitRollback
from rollout_fleet.core.validate import Vocabulary
from rollout_fleet.ports.placement import PlacementKind
from rollout_fleet.wiring.config import ConfigError, parse_config

JOIN = GroupJoin(host="127.0.0.1", port=1, world_size=2, train_world_size=1, first_rank=1,
                 ranks_per_worker=1, timeout_s=2.0, backend="gloo")


@pytest.mark.parametrize("vocabulary", [RefitProtocol, RefitRollback, ColocatedStep, PlacementKind])
def test_each_member_reads_and_prints_as_its_old_spelling(vocabulary):
    assert issubclass(vocabulary, str) and issubclass(vocabulary, Vocabulary)
    for member in vocabulary:
        assert vocabulary.parse(member.value, "field") is member
        assert member == member.value and f"{member}" == str(member) == member.value
        assert json.dumps(member) == json.dumps(member.value)


def test_a_bad_spelling_is_refused_naming_the_field_and_the_spellings():
    with pytest.raises(InvalidValue, match="^rollback=sometimes: must be one of none, last_good$"):
        RefitRollback.parse("sometimes", "rollback")
    with pytest.raises(InvalidValue, match="protocol"):
        RefitProtocol.parse(["vllm"], "protocol")  # unhashable: refused the same way
    with pytest.raises(InvalidValue, match="must be one of rollout-fleet-colocated-v1$"):
        RefitProtocol.parse("vllm", "protocol", (RefitProtocol.COLOCATED,))


def test_the_engines_refit_settings_are_read_into_their_enums():
    config = VllmEngineConfig(model="/m", refit_protocol="rollout-fleet-sharded-v1",
                              refit_rollback="none")
    assert config.refit_protocol is RefitProtocol.SHARDED
    assert config.rollback is RefitRollback.NONE
    assert VllmEngineConfig(model="/m").rollback is RefitRollback.LAST_GOOD  # the CPU default
    with pytest.raises(InvalidValue, match="refit_rollback=sometimes: must be one of none, last_good"):
        VllmEngineConfig(model="/m", refit_rollback="sometimes")
    with pytest.raises(InvalidValue, match="refit_protocol=rollout-fleet-colocated-v1: must be one"
                       " of rollout-fleet-packed-v1, vllm, rollout-fleet-sharded-v1"):
        VllmEngineConfig(model="/m", refit_protocol="rollout-fleet-colocated-v1")


def test_the_config_file_names_a_bad_engine_refit_setting():
    with pytest.raises(ConfigError, match="engine.refit_rollback: must be one of none, last_good"
                       " \\(got 'sometimes'\\)"):
        parse_config({"engine": {"kind": "vllm", "refit_rollback": "sometimes"}})


def test_the_placement_is_read_into_its_enum_and_a_bad_one_is_named():
    assert parse_config({"engine": {"kind": "memory"}, "placement": "local"}).placement \
        is PlacementKind.LOCAL
    assert parse_config({"engine": {"kind": "memory"}}).placement is PlacementKind.RAY
    with pytest.raises(ConfigError, match="placement: Input should be 'ray' or 'local' \\(got 'cloud'\\)"):
        parse_config({"engine": {"kind": "memory"}, "placement": "cloud"})


def test_the_sender_spec_in_a_join_crosses_the_wire_as_its_spelling():
    join = GroupJoin(**{**JOIN.to_wire(), "sender_spec": CollectiveSenderSpec(RefitProtocol.VLLM)})
    wire = json.loads(json.dumps(join.to_wire()))
    assert wire["sender_spec"]["protocol"] == "vllm"
    assert GroupJoin.from_wire(wire).sender_spec.protocol is RefitProtocol.VLLM


def test_the_transfer_engines_rollback_is_read_from_its_spelling():
    wire = {"join": JOIN.to_wire(), "rollback": "last_good"}
    assert PackedInitInfo.from_wire(wire).rollback is RefitRollback.LAST_GOOD
    assert PackedInitInfo.from_wire(PackedInitInfo.from_wire(wire).to_wire()).group_join == JOIN
    with pytest.raises(InvalidValue, match="rollback=sometimes: must be one of none, last_good"):
        PackedInitInfo.from_wire({**wire, "rollback": "sometimes"})
    with pytest.raises(ValueError, match="invalid init_info for rollout_fleet_packed: keys"):
        PackedInitInfo.from_wire({**wire, "joins": {}})


def test_an_unknown_colocated_step_is_refused_by_name():
    engine = ColocatedTransferEngine(None, None, torch.device("cpu"), model=None)
    with pytest.raises(InvalidValue, match="colocated step=resume: must be one of begin, bucket, buckets,"
                       " end, abort"):
        engine.update_weights({"colocated": {"resume": {}}})
