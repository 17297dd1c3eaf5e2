"""One fleet worker: engine + DynamoEngineAdapter + Dynamo endpoint, from a config.

Run as a process::

    python -m rollout_fleet.wiring.worker --config worker.json --control-secret-stdin

or in-process: ``await serve_worker(config)``. The config is a ``WorkerConfig``
(``wiring/worker_config.py``: every key below is one of its fields; any other is refused by
name), written by the fleet as a JSON object::

    {
      "engine": {"kind": "memory", "seed": 0, "context_length": 256, "token_delay_s": 0.0},
      "run_dir": "/tmp/run",           # discovery folder, HOME, model folders (shared with the frontend)
      "namespace": "fleet",
      "served_model_name": "mem",
      "model_path": null,              # optional: the memory engine writes its own folder
      "system_port": 18081,            # POST /engine/control/<name> is served here
      "control_secret": null,          # every control body must carry it (or --control-secret-stdin)
      "kv_routing": false,             # publish the engine's KV events to a KV router
      "bind_host": "127.0.0.1",        # where its servers listen ($ROLLOUT_FLEET_BIND_HOST wins)
      "sigterm_grace_s": 15,           # after SIGTERM, exit anyway if still running by then
      "hang_timeout_s": 120            # busy engine, no step completed this long: it is hung
    }

The engine's kind is found by name in the entry-point group ``rollout_fleet.engines``
(``wiring/engines.py``); it returns the engine, its model folder and any extra controls the
worker should serve. The worker runs until SIGTERM (Dynamo drains and
unregisters, then this returns).

The control secret is required: a worker without one refuses to start. The fleet never writes
it into the config (a file) nor the command line or environment (which other users of the node
can read): with ``--control-secret-stdin`` the worker reads it as the first line of its standard
input, which the placement writes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout_fleet.core.engine import EnginePort
from rollout_fleet.core.errors import EngineDead, EngineHung, InvalidValue
from rollout_fleet.core.progress_watch import ProgressWatch
from rollout_fleet.ports.engine_kind import BuiltEngine, Control
from rollout_fleet.wiring.engines import EngineChoice
from rollout_fleet.wiring.ipc_stream_controls import ipc_stream_controls
from rollout_fleet.wiring.worker_config import WorkerConfig
from rollout_fleet.wiring.worker_exit import (
    arm_exit_deadline, exit_now, kill_child_processes, set_exit_deadline,
)

logger = logging.getLogger("rollout_fleet.worker")
# The last line a worker that fails writes: its exception's own message, which the fleet reports.
FAILURE_MARK = "rollout-fleet worker failed: "
# Set by the placement: the address this worker's servers bind (its node's cluster address
# when the fleet spans nodes); the config's ``bind_host``, else loopback, when it is unset.
BIND_HOST_ENV = "ROLLOUT_FLEET_BIND_HOST"
# Set by the placement: a folder of this worker's own on its node, removed once the worker is
# gone (killed too): vLLM's ipc:// socket files go there unless the user chose their place.
FOLDER_ENV = "ROLLOUT_FLEET_WORKER_FOLDER"
_VLLM_IPC_ENV = "VLLM_RPC_BASE_PATH"
# How often a worker checks that its engine is alive (a dead one takes the worker out at once).
ENGINE_WATCH_INTERVAL_S = 0.1
# How long a worker whose engine died waits for its last answers to leave before it stops.
ANSWERS_FLUSH_S = 2.0
# A worker run without a fleet: long enough for a loaded CPU engine (the fleet sets its own).
DEFAULT_HANG_TIMEOUT_S = 120.0
# What every worker imports, whatever its engine (this module, and what its functions import
# when a worker serves), plus the memory engine's: a local placement's worker template imports
# these once and forks the workers from there. No module here may start a thread when
# imported, nor import torch or vLLM (a CUDA context must never be forked).
PRELOAD = (
    "rollout_fleet.wiring.worker", "rollout_fleet.adapters.dynamo",
    "rollout_fleet.adapters.dynamo.control_front", "rollout_fleet.adapters.dynamo.controls",
    "rollout_fleet.adapters.dynamo.plain", "rollout_fleet.adapters.dynamo.worker_metrics",
    "rollout_fleet.adapters.shared.streams", "dynamo.common.backend",
    "dynamo.common.backend.metrics", "prometheus_client", "rollout_fleet.core.refit_service",
    "rollout_fleet.core.colocated_service", "rollout_fleet.core.sleep",
    "rollout_fleet.core.disk_reload", "rollout_fleet.adapters.memory",
    "rollout_fleet.adapters.http.control",
)

def build_engine(config: WorkerConfig | Mapping[str, Any]) -> BuiltEngine:
    """The engine of ``config.engine``, made by its kind (an entry point of the group
    ``rollout_fleet.engines``)."""
    config = WorkerConfig.from_mapping(config)
    return EngineChoice.parse(config.engine, None).build(run_dir=Path(config.run_dir),
                                                         model_path=config.model_path)


def refit_controls(engine: Any, config: WorkerConfig) -> dict[str, Control]:
    """The refit controls (init_collective, prepare_refit_info, update_weights) of an engine
    that implements the refit port; the cache flush and weight version are the adapter's."""
    from rollout_fleet.core.refit_service import WorkerRefit
    from rollout_fleet.ports.engine import RefitTarget, refit_target

    if not isinstance(engine, RefitTarget):
        return {}
    controls = WorkerRefit(refit_target(engine), config.collective_backend).controls()
    picked = {name: controls[name] for name in ("init_collective", "prepare_refit_info", "update_weights")}
    return {**picked, **colocated_controls(engine), **ipc_stream_controls(
        engine, run_dir=config.run_dir, worker_id=config.worker_id or "worker")}


def colocated_controls(engine: Any) -> dict[str, Control]:
    """colocated_start / _bucket / _finish / _abort, for an engine that takes colocated refits."""
    from rollout_fleet.core.colocated_service import WorkerColocatedRefit
    from rollout_fleet.ports.colocated import ColocatedTarget

    if not isinstance(engine, ColocatedTarget):
        return {}
    return dict(WorkerColocatedRefit(engine).controls())  # its handlers take any mapping


def sleep_controls(engine: Any) -> dict[str, Control]:
    """``sleep``, ``wake_up`` and ``is_sleeping`` of an engine that implements the sleep port
    (core/sleep.py); none for one that does not."""
    from rollout_fleet.core.sleep import WorkerSleep
    from rollout_fleet.ports.engine import Sleeper

    return dict(WorkerSleep(engine).controls()) if isinstance(engine, Sleeper) else {}


def disk_reload_controls(engine: Any, config: WorkerConfig) -> dict[str, Control]:
    """``check_checkpoint`` and ``reload_weights`` (core/disk_reload.py) of an engine that
    reloads its weights from a checkpoint folder; for any other, both refuse naming its kind."""
    from rollout_fleet.core.disk_reload import WorkerDiskReload, refusing_disk_reload
    from rollout_fleet.ports.engine import DiskReloadTarget

    if isinstance(engine, DiskReloadTarget):
        return dict(WorkerDiskReload(engine).controls())
    return dict(refusing_disk_reload(str(config.engine.get("kind", type(engine).__name__))))


def worker_env(config: WorkerConfig | Mapping[str, Any]) -> dict[str, str]:
    """The DYN_* environment of this worker (the Dynamo runtime reads it once, at start), and
    where vLLM puts its socket files."""
    from rollout_fleet.adapters.dynamo.env import dynamo_env

    config = WorkerConfig.from_mapping(config)
    host = os.environ.get(BIND_HOST_ENV) or config.bind_host or "127.0.0.1"
    env = dynamo_env(config.run_dir, system_port=config.system_port,
                     log_level=config.log_level, host=host)
    env.update(config.env)  # the fleet's discovery choice (etcd) and the like
    folder = os.environ.get(FOLDER_ENV)
    if folder and not os.environ.get(_VLLM_IPC_ENV) and _VLLM_IPC_ENV not in env:
        env[_VLLM_IPC_ENV] = folder
    return env


async def serve_worker(config: WorkerConfig | Mapping[str, Any]) -> None:
    """Build the engine and serve it through Dynamo; returns once Dynamo has shut down.

    Dynamo's worker stops only on SIGTERM/SIGINT to this process (it drains, unregisters, runs
    ``cleanup``): cancelling this coroutine does NOT stop it serving.
    """
    from rollout_fleet.adapters.dynamo import DynamoEngineAdapter, start_dynamo_endpoint
    from rollout_fleet.adapters.http.control import HttpPeers

    config = WorkerConfig.from_mapping(config)
    if config.served_model_name is None:
        raise InvalidValue("served_model_name", None, "the worker config needs it")
    secret = control_secret(config)
    held = hold_until_refit(config)
    watch_progress = ProgressWatch(hang_timeout_s(config))
    built = build_engine(config)
    refit = refit_controls(built.engine, config)
    if held and not refit:
        await built.engine.close()
        raise InvalidValue("hold_until_refit", held, "this worker's engine cannot be refit, "
                           "so nothing would ever end the hold")
    peers = HttpPeers(secret)  # the workers it passes relayed controls on to
    adapter = DynamoEngineAdapter(built.engine, control_secret=secret, hold_until_refit=held,
                                  controls={**built.controls, **refit,
                                            **sleep_controls(built.engine),
                                            **disk_reload_controls(built.engine, config)},
                                  worker_name=config.worker_id, peers=peers.control)
    env = worker_env(config)
    Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
    watch = front = None
    try:
        front = await _front_the_system_port(adapter, env)
        serving = start_dynamo_endpoint(
            adapter, model_path=built.model_path,
            served_model_name=config.served_model_name,
            namespace=config.namespace, engine_env=env, enable_kv_routing=config.kv_routing,
            chat=config.chat)
        watch = asyncio.ensure_future(_leave_when_engine_dies(built.engine, adapter, watch_progress))
        await serving
    finally:
        logger.info("worker: Dynamo has stopped serving; stopping the rest")
        if watch is not None:
            watch.cancel()
        if front is not None:
            await _timed("closing the control front", front.close())
        await peers.aclose()
        if _is_hang(adapter.dead_reason):
            kill_child_processes()  # a stopped engine process would never answer its close
        # vLLM: stop its engine-core processes now
        await _timed("closing the engine", built.engine.close())
    if adapter.dead_reason is not None:  # the worker exits non-zero, naming why
        raise (EngineHung if _is_hang(adapter.dead_reason) else EngineDead)(adapter.dead_reason)


async def _timed(step: str, awaitable: Any) -> Any:
    """Await one step of the worker's stop and log its seconds: a slow stop shows where."""
    started = time.monotonic()
    try:
        return await awaitable
    finally:
        logger.info("worker: %s took %.2f s", step, time.monotonic() - started)


async def _front_the_system_port(adapter: Any, env: dict[str, str]) -> Any:
    """Serve the system port with the worker's own front (controls answer 401 when refused)
    and move Dynamo's system server behind it, to another port of the same host: Dynamo
    advertises that address, and the frontend fetches the model's files from it, from another
    node when the fleet spans nodes. None without a system port."""
    from rollout_fleet.adapters.dynamo.control_front import ControlFront
    from rollout_fleet.adapters.shared import free_port

    port = int(env.get("DYN_SYSTEM_PORT") or os.environ.get("DYN_SYSTEM_PORT") or -1)
    if port <= 0:
        return None
    host = env.get("DYN_SYSTEM_HOST") or "127.0.0.1"
    inner = free_port(host)
    env.update(DYN_SYSTEM_PORT=str(inner), DYN_SYSTEM_HOST=host)
    front = ControlFront(adapter.controls, f"http://{_url_host(host)}:{inner}")
    await front.start(host, port)
    return front


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


HANG_REASON_PREFIX = "engine hung: "


def _is_hang(reason: str | None) -> bool:
    return reason is not None and reason.startswith(HANG_REASON_PREFIX)


def _hang_reason(engine: EnginePort, adapter: Any, watch: ProgressWatch) -> str | None:
    """Why the engine counts as hung now (busy, no step for hang_timeout_s), else None. A
    control call (a refit pauses the engine) holds the clock back."""
    # Asleep (a keep-mode sleep holds its rollouts) is no hang either.
    busy = adapter.requests_in_flight > 0 and adapter.controls_running == 0 \
        and not _asleep(engine)
    stalled = watch.observe(time.monotonic(), engine.progress(), busy)
    if stalled is None:
        return None
    return (f"{HANG_REASON_PREFIX}no step completed in {stalled:.1f} s with "
            f"{adapter.requests_in_flight} request(s) waiting on it (hang_timeout_s="
            f"{watch.hang_timeout_s:g})")


def _asleep(engine: EnginePort) -> bool:
    from rollout_fleet.ports.engine import Sleeper

    return isinstance(engine, Sleeper) and engine.is_sleeping()


async def _leave_when_engine_dies(engine: EnginePort, adapter: Any, watch: ProgressWatch) -> None:
    """Once the engine is dead or hung (an idle worker too), leave the fleet at once: refuse
    every request, then stop as on SIGTERM, so Dynamo takes this worker out of discovery."""
    watched = engine.progress() is not None
    while True:
        reason = engine.dead_reason() or adapter.dead_reason
        if reason is None and watched:
            reason = _hang_reason(engine, adapter, watch)
        if reason is not None:
            adapter.engine_died(reason)  # every request it held is answered 503 now
            logger.error("worker: leaving the fleet: %s", reason)
            # Its last word now, not at exit: a stop slowed by load can end in the SIGTERM grace
            # period's hard exit, which writes none (the fleet then knew only that it exited).
            kind = (EngineHung if _is_hang(reason) else EngineDead).__name__  # as main() says it
            print(f"{FAILURE_MARK}{kind}: {reason}", file=sys.stderr, flush=True)
            # The stop's deadline runs from now, whatever becomes of the SIGTERM below.
            arm_exit_deadline("its engine was lost")
            deadline = time.monotonic() + ANSWERS_FLUSH_S
            while adapter.requests_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # let those answers leave before Dynamo stops
            os.kill(os.getpid(), signal.SIGTERM)
            return
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)


def control_secret(config: WorkerConfig) -> str:
    """The secret every control must carry."""
    secret = config.control_secret
    if secret is None:
        raise InvalidValue("control_secret", None,
                           "is required: without it anyone who reaches the worker's system port "
                           "could refit or abort it (start the worker with --control-secret-stdin "
                           "and write the secret as the first line of its standard input)")
    if not isinstance(secret, str) or not secret.strip():
        raise InvalidValue("control_secret", "(hidden)", "must be a non-empty string")
    return secret


def hang_timeout_s(config: WorkerConfig) -> float:
    """How long a busy engine may complete no step before the worker takes it for hung."""
    value = config.hang_timeout_s
    return DEFAULT_HANG_TIMEOUT_S if value is None else value


def hold_until_refit(config: WorkerConfig) -> bool:
    """A worker that joins a running fleet (a replacement, or one more) serves only after its
    first refit has loaded the fleet's current weights."""
    return config.hold_until_refit


def read_secret_from_stdin() -> str:
    """The first line of standard input (the placement's pipe); stdin is then /dev/null, so the
    engine's child processes inherit nothing of it."""
    line = sys.stdin.readline().strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if not line:
        raise InvalidValue("control_secret", None, "--control-secret-stdin: standard input held no secret")
    return line


def load_worker_config(text_or_path: str) -> WorkerConfig:
    """``--config``: a JSON object, or the path of a file holding one."""
    text = text_or_path if text_or_path.lstrip().startswith("{") else Path(text_or_path).read_text()
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise InvalidValue("--config", text_or_path, f"is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidValue("--config", text_or_path, "must hold a JSON object")
    return WorkerConfig.from_mapping(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_fleet.wiring.worker")
    parser.add_argument("--config", required=True, help="a JSON object, or a file holding one")
    parser.add_argument("--control-secret-stdin", action="store_true",
                        help="read the control secret from the first line of standard input")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = load_worker_config(args.config)
        if args.control_secret_stdin:
            config = config.with_secret(read_secret_from_stdin())
        control_secret(config)  # refuse now, before Dynamo or an engine starts
        ProgressWatch(hang_timeout_s(config))
    except InvalidValue as exc:
        print(f"{FAILURE_MARK}{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    # Before Dynamo is imported: its runtime reads the environment (DYN_LOG...) when it loads.
    os.environ.update(worker_env(config))

    try:
        asyncio.run(_serve_until_sigterm(config, config.sigterm_grace_s))
    except Exception as exc:  # noqa: BLE001 - reported in one line, the traceback logged above it
        if isinstance(exc, EngineDead):  # vLLM logged how its engine died; no traceback of ours
            logger.error("worker: stopped, its engine died")
        else:
            logger.exception("worker: failed")
        message = " ".join(str(exc).split()) or "(no message)"
        print(f"{FAILURE_MARK}{type(exc).__name__}: {message}", file=sys.stderr, flush=True)
        if isinstance(exc, EngineDead):
            exit_now(1)
        return 1
    logger.info("worker: stopped")
    gc.freeze()  # the exit's last collection skips the heap: torch's made it ~1 s of CPU
    return 0


async def _serve_until_sigterm(config: WorkerConfig, grace_s: float) -> None:
    set_exit_deadline(grace_s)

    def on_sigterm(signum: int, _frame: Any) -> None:
        # Dynamo's handler runs first (drain, unregister), then this one; serve_worker returns.
        logger.info("worker: SIGTERM received (signal %d), shutting down", signum)
        arm_exit_deadline("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)  # before the endpoint starts, so Dynamo chains it
    logger.info("worker: starting (pid %d)", os.getpid())
    await serve_worker(config)


if __name__ == "__main__":
    sys.exit(main())
