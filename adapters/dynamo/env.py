"""The environment that runs Dynamo on loopback with no etcd and no NATS (see FACTS.md).

Pure: builds a dict; the frontend launcher gives it to its child, the worker entry point puts it
into its own ``os.environ`` before the Dynamo runtime starts (the runtime reads it once).
"""

from __future__ import annotations

from pathlib import Path

from rollout_fleet.core.validate import check_int_in

LOOPBACK = "127.0.0.1"
MAX_SYSTEM_PORT = 32767  # DYN_SYSTEM_PORT is parsed as an i16


def dynamo_env(run_dir: str | Path, *, system_port: int | None = None,
               log_level: str = "warn") -> dict[str, str]:
    """DYN_* variables for one process of a run whose discovery folder lives in ``run_dir``.

    ``system_port``: the worker's system server (health, ``/engine/control/<name>``); None
    leaves it off (the frontend needs none).
    """
    run_dir = Path(run_dir)
    env = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(run_dir / "discovery"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": LOOPBACK,
        "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
        "DYN_EVENT_PLANE_HOST": LOOPBACK,
        "DYN_SYSTEM_HOST": LOOPBACK,
        "DYN_HTTP_HOST": LOOPBACK,
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",  # else SIGTERM waits 5 s
        "DYN_LOG": log_level,  # info writes ~5 lines per request
        "HOME": str(run_dir / "home"),  # workers copy model files under $HOME/.cache
        "HF_HUB_OFFLINE": "1",
    }
    if system_port is not None:
        check_int_in("system_port", system_port, 1, MAX_SYSTEM_PORT,
                     f"Dynamo reads it as a signed 16-bit int: 1..{MAX_SYSTEM_PORT}")
        env["DYN_SYSTEM_PORT"] = str(system_port)
    return env
