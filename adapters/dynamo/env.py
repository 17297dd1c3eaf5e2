"""The environment that runs Dynamo 1.6.1 with no NATS (TCP request plane, ZMQ event plane,
every host setting named): on loopback with file discovery on one machine, or on one node's
cluster address (etcd discovery) across nodes.

Builds a dict (reading only where vLLM's and the kernel caches live from this process's
environment); the frontend launcher gives it to its child, the worker entry point puts it into
its own ``os.environ`` before the Dynamo runtime starts (the runtime reads it once).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.validate import check_int_in

LOOPBACK = "127.0.0.1"
MAX_SYSTEM_PORT = 32767  # DYN_SYSTEM_PORT is parsed as an i16


def check_bind_host(field: str, host: object) -> str:
    """An IP address literal of one interface: never the wildcard (0.0.0.0, ::), which would
    open every server of the fleet on every network the node is on."""
    not_an_address = ("must be an IP address of this node (e.g. 127.0.0.1, or its address on "
                      "the cluster network)")
    if not isinstance(host, str):
        raise InvalidValue(field, host, not_an_address)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise InvalidValue(field, host, not_an_address) from None
    if address.is_unspecified:
        raise InvalidValue(field, host, "binds every interface; give the node's own address "
                           "on the cluster network (or 127.0.0.1 on one machine)")
    return host


def vllm_cache_root() -> str:
    """vLLM's cache where vLLM itself would keep it (``$VLLM_CACHE_ROOT``, else the launching
    user's ``~/.cache/vllm``), not under the run's HOME: its model inspections (a subprocess
    that imports vLLM, ~14 s of CPU here) and compiled graphs are then done once per machine,
    not once per worker start."""
    if os.environ.get("VLLM_CACHE_ROOT"):
        return os.environ["VLLM_CACHE_ROOT"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "vllm")


# Kernel caches that live under HOME unless named, each filled once per machine by a JIT
# compile (CUDA's PTX, FlashInfer's modules and cubins, Triton's kernels, DeepGEMM's,
# torch's C++ extensions): under the run's own HOME every fleet start would compile them
# again, where vLLM's own server finds them warm in its user's home. Per variable: the root
# its tool puts the cache under when that root's own variable is set (Triton's TRITON_HOME,
# torch's XDG_CACHE_HOME), the root's place under HOME otherwise, and the cache in the root.
_HOME_KERNEL_CACHES = {
    "CUDA_CACHE_PATH": (None, (), (".nv", "ComputeCache")),
    "FLASHINFER_WORKSPACE_BASE": (None, (), ()),
    "TRITON_CACHE_DIR": ("TRITON_HOME", (), (".triton", "cache")),
    "DG_JIT_CACHE_DIR": (None, (), (".deep_gemm",)),
    "TORCH_EXTENSIONS_DIR": ("XDG_CACHE_HOME", (".cache",), ("torch_extensions",)),
}


def user_kernel_caches() -> dict[str, str]:
    """Where the launching user's kernel caches are (each variable this process sets is kept
    as it is, and so is a root it sets), for processes whose HOME is the run's own."""
    home = os.path.expanduser("~")
    caches = {}
    for name, (root_variable, root_in_home, in_root) in _HOME_KERNEL_CACHES.items():
        root = os.environ.get(root_variable or "") or os.path.join(home, *root_in_home)
        caches[name] = os.environ.get(name) or os.path.join(root, *in_root)
    return caches


def dynamo_env(run_dir: str | Path, *, system_port: int | None = None,
               log_level: str = "warn", host: str = LOOPBACK) -> dict[str, str]:
    """DYN_* variables for one process of a run whose discovery folder lives in ``run_dir``.

    ``system_port``: the worker's system server (health, ``/engine/control/<name>``); None
    leaves it off (the frontend needs none). ``host``: the address every server of this
    process binds and advertises: loopback on one machine, this node's cluster address when
    the fleet spans nodes (other nodes connect to its request plane and response stream).
    """
    check_bind_host("host", host)
    run_dir = Path(run_dir)
    env = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(run_dir / "discovery"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": host,
        "DYN_TCP_RESPONSE_STREAM_HOST": host,
        "DYN_EVENT_PLANE_HOST": host,
        "DYN_SYSTEM_HOST": host,
        "DYN_HTTP_HOST": host,
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",  # else SIGTERM waits 5 s
        "DYN_LOG": log_level,  # info writes ~5 lines per request
        "HOME": str(run_dir / "home"),  # workers copy model files under $HOME/.cache
        "VLLM_CACHE_ROOT": vllm_cache_root(),
        **user_kernel_caches(),
        "HF_HUB_OFFLINE": "1",
    }
    if system_port is not None:
        check_int_in("system_port", system_port, 1, MAX_SYSTEM_PORT,
                     f"Dynamo reads it as a signed 16-bit int: 1..{MAX_SYSTEM_PORT}")
        env["DYN_SYSTEM_PORT"] = str(system_port)
    return env
