"""Dynamo adapter: serve any engine port through Dynamo's backend SDK, run Dynamo's frontend.

The names that need Dynamo itself load on first use, so ``env`` and ``frontend`` can be used
before Dynamo is imported: its runtime reads DYN_LOG and friends once, when it loads.
"""

from __future__ import annotations

import importlib
from typing import Any

from rollout_fleet.adapters.dynamo.env import LOOPBACK, dynamo_env
from rollout_fleet.adapters.dynamo.frontend import DynamoFrontend, FrontendError, ModelRejected

_LAZY = {
    "CONTROL_SECRET_FIELD": "rollout_fleet.adapters.dynamo.controls",
    "DynamoEngineAdapter": "rollout_fleet.adapters.dynamo.adapter",
    "start_dynamo_endpoint": "rollout_fleet.adapters.dynamo.endpoint",
}

__all__ = [
    "CONTROL_SECRET_FIELD",
    "DynamoEngineAdapter",
    "DynamoFrontend",
    "FrontendError",
    "ModelRejected",
    "LOOPBACK",
    "dynamo_env",
    "start_dynamo_endpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
