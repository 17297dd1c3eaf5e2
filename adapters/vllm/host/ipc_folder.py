"""Where a vLLM engine's ipc:// socket files go: vLLM's own queues' (named by vLLM in
``VLLM_RPC_BASE_PATH``, else the temp folder) and the KV-event publisher's (named by its port)."""

from __future__ import annotations

import os
import tempfile

RPC_BASE_PATH = "VLLM_RPC_BASE_PATH"
ENGINE_FOLDER_PREFIX = "rollout-fleet-vllm-"  # a folder an engine made for itself, while it starts


def chosen_ipc_folder() -> str | None:
    """The folder chosen for them in ``VLLM_RPC_BASE_PATH`` (the user's, or a fleet worker's
    own, which its placement removes once the worker is gone, killed too); None when nothing
    is chosen. An engine's own folder, set there only while it starts, is not a choice."""
    chosen = os.environ.get(RPC_BASE_PATH)
    if chosen and not os.path.basename(chosen).startswith(ENGINE_FOLDER_PREFIX):
        return chosen
    return None


def kv_events_socket(port: int) -> str:
    """The KV-event publisher's socket file: in the chosen folder, else the temp folder."""
    return os.path.join(chosen_ipc_folder() or tempfile.gettempdir(),
                        f"rollout-fleet-kv-events-{port}")
