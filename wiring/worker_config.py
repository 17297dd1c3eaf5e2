"""What a fleet tells one worker: a typed record from the fleet, which writes it as JSON, to the
worker process, which reads the same type back (``WorkerConfig.from_mapping``).

The engine table stays a mapping here: its fields belong to the engine's kind, which checks
them itself when it builds the engine (``wiring/engines.py``). Every other key is a field below;
an unknown key is refused by name, so a misspelt setting never passes silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.validate import (
    check_bool, check_known_keys, finite_at_least, is_int, non_empty_str,
)

DEFAULT_SIGTERM_GRACE_S = 15.0


def _bool(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_bool(attribute.name, value)


def _optional_str(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidValue(attribute.name, value, "must be a non-empty string or null")


def _optional_port(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not is_int(value) or not 0 < value < 65536):
        raise InvalidValue(attribute.name, value, "must be a port number (1-65535) or null")


def _optional_positive(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        finite_at_least(attribute.name, 0.0, strictly=True)(inst, attribute, value)


def _engine(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise InvalidValue("engine", value, "must be a table with at least its kind")


def _env(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidValue(attribute.name, value, "must map names to strings")


@attrs.frozen(kw_only=True)
class WorkerConfig:
    """One worker's settings (``python -m rollout_fleet.wiring.worker --config FILE``)."""

    run_dir: str = attrs.field(validator=non_empty_str("run_dir"))  # discovery, HOME, models
    engine: Mapping[str, Any] = attrs.field(factory=dict, validator=_engine)
    served_model_name: str | None = attrs.field(default=None, validator=_optional_str)
    namespace: str = attrs.field(default="fleet", validator=non_empty_str("namespace"))
    model_path: str | None = attrs.field(default=None, validator=_optional_str)
    system_port: int | None = attrs.field(default=None, validator=_optional_port)  # controls
    control_secret: str | None = attrs.field(default=None, repr=False)  # checked by the worker
    kv_routing: bool = attrs.field(default=False, validator=_bool)  # publish KV events
    bind_host: str | None = attrs.field(default=None, validator=_optional_str)
    sigterm_grace_s: float = attrs.field(default=DEFAULT_SIGTERM_GRACE_S,
                                         validator=finite_at_least("sigterm_grace_s", 0.0))
    hang_timeout_s: float | None = attrs.field(default=None, validator=_optional_positive)
    collective_backend: str = attrs.field(default="gloo",
                                          validator=non_empty_str("collective_backend"))
    log_level: str = attrs.field(default="warn", validator=non_empty_str("log_level"))
    env: Mapping[str, str] = attrs.field(factory=dict, validator=_env)  # e.g. etcd discovery
    hold_until_refit: bool = attrs.field(default=False, validator=_bool)  # joins a running fleet
    worker_id: str | None = attrs.field(default=None, validator=_optional_str)  # "worker-0"
    # tool_call_parser, reasoning_parser, custom_jinja_template (checked by the fleet's config)
    chat: Mapping[str, str] = attrs.field(factory=dict, validator=_env)

    @classmethod
    def from_mapping(cls, data: "WorkerConfig | Mapping[str, Any]") -> "WorkerConfig":
        if isinstance(data, WorkerConfig):
            return data
        if not isinstance(data, Mapping):
            raise InvalidValue("worker config", data, "must be a JSON object")
        check_known_keys(data, {field.name for field in attrs.fields(cls)})
        if data.get("run_dir") in (None, ""):
            raise InvalidValue("run_dir", data.get("run_dir"), "the worker config needs it")
        return cls(**data)

    def with_secret(self, secret: str) -> "WorkerConfig":
        return attrs.evolve(self, control_secret=secret)

    def to_json(self) -> str:
        """The file the fleet writes; never with the secret in it (the worker reads that from
        its standard input)."""
        fields = attrs.asdict(self, recurse=False)
        fields.pop("control_secret")
        return json.dumps({key: (dict(value) if isinstance(value, Mapping) else value)
                           for key, value in fields.items()}, indent=1)
