"""Serve a DynamoEngineAdapter on the running event loop, inside a host process.

The host keeps its logging (Dynamo's ``configure_dynamo_logging`` would remove every handler
of the root logger) and its own SIGTERM handler keeps running after Dynamo's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dynamo.common.backend.worker as dynamo_worker
from dynamo.common.backend import Worker, WorkerConfig
from rollout_fleet.adapters.dynamo.adapter import DynamoEngineAdapter

logger = logging.getLogger(__name__)


def start_dynamo_endpoint(adapter: DynamoEngineAdapter, *, model_path: str,
                          served_model_name: str, namespace: str,
                          engine_env: Mapping[str, str], component: str = "backend",
                          endpoint: str = "generate",
                          enable_kv_routing: bool = False,
                          chat: Mapping[str, str] | None = None) -> asyncio.Task:
    """Register the adapter's engine with Dynamo and serve it; returns the serving task.

    ``engine_env``: the DYN_* variables (``dynamo_env``); put into ``os.environ`` now because
    the Dynamo runtime reads them once, when it starts. ``enable_kv_routing`` stays off unless
    the engine publishes KV events: Dynamo binds those sockets on every interface.
    The task ends when Dynamo has shut down, on SIGTERM/SIGINT to this process: cancelling the
    task does NOT stop Dynamo's worker (it keeps serving; checked with 1.6.1).

    SIGTERM: Dynamo's runtime installs its own handler (graceful shutdown: unregister, drain,
    ``cleanup``) and then calls the handler that was installed before it, so the host's handler
    still runs. Install the host's SIGTERM handler (``signal.signal``) BEFORE calling this: one
    installed after replaces Dynamo's. ``loop.add_signal_handler`` for SIGTERM/SIGINT is
    silently ignored once Dynamo's worker runs.

    ``chat``: ``tool_call_parser``, ``reasoning_parser``, ``custom_jinja_template`` (checked by
    ``chat.check_chat_settings``), registered with the model: Dynamo's frontend renders that
    template and runs those parsers on the model's text.
    """
    chat = dict(chat or {})
    loop = asyncio.get_running_loop()
    os.environ.update(engine_env)
    adapter.set_model(str(model_path), served_model_name)
    config = WorkerConfig(
        namespace=namespace,
        component=component,
        endpoint=endpoint,
        model_name=str(model_path),
        served_model_name=served_model_name,
        endpoint_types=endpoint_types(model_path, chat.get("custom_jinja_template")),
        discovery_backend=engine_env.get("DYN_DISCOVERY_BACKEND", "file"),
        request_plane=engine_env.get("DYN_REQUEST_PLANE", "tcp"),
        event_plane=engine_env.get("DYN_EVENT_PLANE", "zmq"),
        enable_kv_routing=enable_kv_routing,
        tool_call_parser=chat.get("tool_call_parser"),
        reasoning_parser=chat.get("reasoning_parser"),
        custom_jinja_template=chat.get("custom_jinja_template"),
    )
    _keep_host_logging()
    return loop.create_task(Worker(adapter, config).run(),
                            name=f"dynamo-endpoint:{namespace}.{component}.{endpoint}")


def endpoint_types(model_path: str | os.PathLike, custom_template: str | None = None) -> str:
    """What the model registers for: chat and completions, or completions only for a folder
    without a chat template (most base models) and no custom one. Dynamo's frontend refuses to
    materialise a chat model without one; registered for completions only, it serves
    completions and answers chat with a 404. Dynamo reads the template from
    ``tokenizer_config.json`` only."""
    if custom_template:
        return "chat,completions"
    try:
        config = json.loads((Path(model_path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict) and config.get("chat_template"):
        return "chat,completions"
    logger.warning("%s has no chat template: registered for completions only", model_path)
    return "completions"


def _keep_host_logging() -> None:
    """Dynamo's Worker.run calls configure_dynamo_logging, which swaps out the root logger's
    handlers; in a host process those belong to the host. Replace the call by a no-op."""
    dynamo_worker.configure_dynamo_logging = _leave_logging_alone


def _leave_logging_alone(*_args: Any, **_kwargs: Any) -> None:
    logger.debug("kept the host's logging configuration (Dynamo's was not applied)")
