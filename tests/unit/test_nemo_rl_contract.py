"""The replay's restatement of NeMo-RL's side (tests/support/nemo_rl_contract.py and
nemo_rl_config_checks.py) behaves as NeMo-RL does on what the replay relies on: batches join
and pad, the padding check finds what is wrong, the config checks take the example config and
refuse what NeMo-RL refuses for its Dynamo backend."""

from __future__ import annotations

import pytest
import torch

from tests.support.nemo_rl_config_checks import check_dynamo_generation_config
from tests.support.nemo_rl_contract import TensorBatch, right_padding_problem
from tests.support.nemo_rl_example_config import example_generation_config


def test_joined_batches_stack_rows_padding_the_wider_keys():
    first = {"output_ids": torch.tensor([[1, 2, 3]]), "lengths": torch.tensor([3]),
             "stop_strings": [None]}
    second = {"output_ids": torch.tensor([[4, 5]]), "lengths": torch.tensor([2]),
              "stop_strings": [["x"]]}
    joined = TensorBatch.join([first, second], pad_values={"output_ids": 9})
    assert joined["output_ids"].tolist() == [[1, 2, 3], [4, 5, 9]]
    assert joined["lengths"].tolist() == [3, 2]
    assert joined["stop_strings"] == [None, ["x"]]
    assert list(joined) == ["lengths", "output_ids", "stop_strings"]
    assert joined.size() == 2 and TensorBatch().size() == 0


@pytest.mark.parametrize("ids, lengths, problem", [
    ([[1, 2, 0], [3, 0, 0]], [2, 1], None),
    ([[1, 2, 5]], [2], "row 0: tokens other than the pad after its length, at [2]"),
    ([[1, 2, 0]], [4], "row 0: length 4 is beyond the width 3"),
    ([[1, 2, 0]], [2, 2], "2 lengths for 1 rows"),
])
def test_the_padding_check_names_what_is_wrong(ids, lengths, problem):
    batch = TensorBatch(input_ids=torch.tensor(ids), input_lengths=torch.tensor(lengths))
    assert right_padding_problem(batch, 0) == problem


def prepared_example() -> dict:
    """The example as NeMo-RL's setup hands it on (the load format is its to set)."""
    config = example_generation_config()
    config["vllm_cfg"]["load_format"] = "dummy"
    return config


def test_the_example_config_passes_the_checks():
    check_dynamo_generation_config(prepared_example())


@pytest.mark.parametrize("section, key, value, named", [
    ("vllm_cfg", "precision", "float32", "precision"),
    ("vllm_cfg", "kv_cache_dtype", "fp8", "kv_cache_dtype"),
    ("vllm_cfg", "expert_parallel_size", 2, "expert_parallel_size"),
    ("vllm_cfg", "logprobs_mode", "raw_logprobs", "logprobs_mode"),
    ("vllm_kwargs", "data_parallel_size", 2, "data_parallel_size"),
    ("colocated", "enabled", True, "colocated.enabled"),
    (None, "refit_transport", "nixl", "refit_transport"),
    (None, "stop_strings", ["stop"] * 33, "stop_strings"),
])
def test_the_checks_refuse_what_nemo_rl_refuses(section, key, value, named):
    config = prepared_example()
    (config[section] if section else config)[key] = value
    with pytest.raises(ValueError, match=named):
        check_dynamo_generation_config(config)


def test_the_checks_refuse_an_unknown_router_mode_and_a_missing_load_format():
    config = prepared_example()
    config["dynamo_cfg"]["frontend_args"]["router_mode"] = "fastest"
    with pytest.raises(ValueError, match="router_mode='fastest'"):
        check_dynamo_generation_config(config)
    config = prepared_example()
    del config["vllm_cfg"]["load_format"]
    with pytest.raises(ValueError, match="vllm_cfg.load_format is missing"):
        check_dynamo_generation_config(config)
