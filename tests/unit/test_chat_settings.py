"""The fleet's chat settings (pure: nothing starts): parser names checked against the lists
the installed Dynamo registers, a template file that must exist, NeMo-RL's worker_args mapped
onto them, and the structured-output constraint a tool_choice asks of the engine."""

from __future__ import annotations

import pytest

from rollout_fleet.adapters.dynamo.chat import offered_parsers
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.sampling import extra_sampling
from rollout_fleet.wiring.config import ConfigError, parse_config
from rollout_fleet.wiring.nemo_rl import read_nemo_rl_config
from rollout_fleet.wiring.worker_config import WorkerConfig
from tests.unit.test_nemo_rl_config import generation_config, tiny  # noqa: F401  (fixture)


def test_dynamo_lists_the_parsers_a_tool_calling_model_needs():
    offered = offered_parsers()
    assert "hermes" in offered["tool_call_parser"]
    assert "qwen3" in offered["reasoning_parser"]


def test_known_parsers_and_a_template_file_are_taken(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    config = parse_config({"engine": {"kind": "memory"}, "chat": {
        "tool_call_parser": "hermes", "reasoning_parser": "qwen3",
        "custom_jinja_template": str(template)}})
    assert config.chat == {"tool_call_parser": "hermes", "reasoning_parser": "qwen3",
                           "custom_jinja_template": str(template.resolve())}


@pytest.mark.parametrize("chat, named", [
    ({"tool_call_parser": "hermess"}, "tool_call_parser='hermess': not a parser this Dynamo"),
    ({"reasoning_parser": "nope"}, "reasoning_parser='nope': not a parser this Dynamo"),
    ({"custom_jinja_template": "/no/such.jinja"}, "custom_jinja_template='/no/such.jinja'"),
    ({"tool_parser": "hermes"}, "tool_parser='hermes': unknown key"),
])
def test_a_bad_chat_setting_is_refused_naming_field_and_value(chat, named):
    with pytest.raises(ConfigError) as refused:
        parse_config({"engine": {"kind": "memory"}, "chat": chat}, source="fleet.toml")
    assert f"fleet.toml: chat: {named}" in str(refused.value)


def test_nemo_rls_worker_args_become_the_fleets_chat_settings(tiny):  # noqa: F811
    config = generation_config(tiny)
    config["dynamo_cfg"]["worker_args"] = {"tool_call_parser": "hermes",
                                           "reasoning_parser": None,
                                           "custom_jinja_template": None}
    assert read_nemo_rl_config(config).fleet.chat == {"tool_call_parser": "hermes"}
    config["dynamo_cfg"]["worker_args"]["reasoning_parser"] = "thinky"
    with pytest.raises(InvalidValue) as refused:
        read_nemo_rl_config(config)
    assert refused.value.field == "policy.generation.dynamo_cfg.worker_args.reasoning_parser"
    assert refused.value.value == "thinky"


def test_each_worker_receives_the_chat_settings():
    worker = WorkerConfig(run_dir="/tmp/x", chat={"tool_call_parser": "hermes"})
    import json

    assert WorkerConfig.from_mapping(json.loads(worker.to_json())).chat == {
        "tool_call_parser": "hermes"}


def test_a_tool_choice_constraint_reaches_the_engine_checked():
    schema = {"type": "object", "properties": {}}
    assert extra_sampling({"structured_outputs": {"json": schema, "backend": "xgrammar"}}) == {
        "structured_outputs": {"json": schema}}
    for bad in ({}, {"json": schema, "regex": "a+"}, {"choice": []}, {"json": 3}, "a+"):
        with pytest.raises(InvalidValue) as refused:
            extra_sampling({"structured_outputs": bad})
        assert refused.value.field.startswith("structured_outputs")
