"""Dynamo adapter: serve any engine port through Dynamo's backend SDK, run Dynamo's frontend."""

from rollout_fleet.adapters.dynamo.adapter import CONTROL_SECRET_FIELD, DynamoEngineAdapter
from rollout_fleet.adapters.dynamo.endpoint import start_dynamo_endpoint
from rollout_fleet.adapters.dynamo.env import LOOPBACK, dynamo_env
from rollout_fleet.adapters.dynamo.frontend import DynamoFrontend, FrontendError, stop_process_group

__all__ = [
    "CONTROL_SECRET_FIELD",
    "DynamoEngineAdapter",
    "DynamoFrontend",
    "FrontendError",
    "LOOPBACK",
    "dynamo_env",
    "start_dynamo_endpoint",
    "stop_process_group",
]
