"""``rollout-fleet refit``: push a safetensors checkpoint into a running fleet.

With ``--checkpoint DIR`` this process becomes the trainer (rank 0) of a refit group: every
worker checks the tensor names, shapes and dtypes first (a mismatch is refused before any
transfer), then joins the group, receives the packed weights and loads them; then every cache
is invalidated and the new weight versions are printed.

With ``--from-disk DIR`` nothing is sent: every worker reads the folder itself with its
engine's own loader (vLLM's reload), so DIR must be readable where each worker runs. Every
worker checks it first (a truncated or missing file, a missing tensor, a wrong shape or dtype
is refused by name, and no worker changes); then each reloads it in keep mode (rollouts in
flight freeze, then go on with the new weights) and the new versions are printed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rollout_fleet.core.errors import InvalidValue, RolloutFleetError
from rollout_fleet.wiring.cli_args import (
    add_frontend_url, add_required_fleet_file, documented_command,
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    refit = documented_command(commands, "refit", doc=__doc__,
                               summary="push a safetensors checkpoint into a running fleet")
    add_required_fleet_file(refit)
    source = refit.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a folder of *.safetensors files, sent over the"
                                             " refit group")
    source.add_argument("--from-disk", metavar="DIR", help="a checkpoint folder every worker"
                                                           " reads and reloads itself")
    add_frontend_url(refit)
    refit.add_argument("--host", default=None,
                       help="address the workers reach this process on for the refit group "
                            "(default: the frontend URL's host)")
    refit.add_argument("--timeout", type=float, default=120.0,
                       help="seconds for each refit step (default 120)")
    refit.set_defaults(run=run_refit)


def run_refit(args: argparse.Namespace) -> int:
    from rollout_fleet.wiring.fleet_file import FleetFile, check_fleet_running

    fleet = FleetFile.read(args.fleet_file)
    check_fleet_running(fleet)
    if not args.timeout > 0:
        raise InvalidValue("--timeout", args.timeout, "must be > 0")
    if args.from_disk is not None:
        return _reload_from_disk(fleet, args)
    state = load_checkpoint(args.checkpoint)
    url = args.url or fleet.frontend_url
    host = args.host or urlsplit(url).hostname or "127.0.0.1"
    generation = _generation(fleet, url, args.timeout)
    try:
        versions, seconds = _push(generation, fleet, state, host, args.timeout)
    finally:
        generation.shutdown()
    print(f"refit {len(state)} tensors into {len(versions)} worker(s) in {seconds:.2f} s")
    for name, version in sorted(versions.items()):
        print(f"{name}: weight version {version}")
    return 0


def _reload_from_disk(fleet, args: argparse.Namespace) -> int:
    folder = Path(args.from_disk).absolute()  # the workers resolve it from their own folders
    generation = _generation(fleet, args.url or fleet.frontend_url, args.timeout)
    started = time.monotonic()
    try:
        versions = generation.reload_weights(str(folder), refit_timeout_s=args.timeout)
    finally:
        generation.shutdown()
    print(f"reloaded {folder} on {len(versions)} worker(s) in"
          f" {time.monotonic() - started:.2f} s")
    for name, version in sorted(versions.items()):
        print(f"{name}: weight version {version}")
    return 0


def load_checkpoint(folder: str) -> dict[str, Any]:
    """Every tensor of DIR/*.safetensors (names must not repeat across files)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder)
    if not path.is_dir():
        raise InvalidValue("--checkpoint", folder, "is not a folder")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidValue("--checkpoint", folder, "holds no *.safetensors file")
    state: dict[str, Any] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise InvalidValue("--checkpoint", str(file), f"cannot be read as safetensors: "
                               f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        repeated = sorted(set(tensors) & set(state))
        if repeated:
            raise InvalidValue("--checkpoint", str(file), f"repeats tensor {repeated[0]!r}")
        state.update(tensors)
    if not state:
        raise InvalidValue("--checkpoint", folder, "holds no tensors")
    return state


def _generation(fleet, url: str, timeout_s: float):
    from rollout_fleet.adapters.nemo_rl import GenerationConfig
    from rollout_fleet.core.refit import CollectiveSenderSpec
    from rollout_fleet.wiring.driver import WorkerEndpoint, build_generation

    config = GenerationConfig(
        model=fleet.served_model_name, max_model_len=fleet.max_model_len,
        max_new_tokens=fleet.max_new_tokens, ranks_per_worker=fleet.ranks_per_worker,
        sender_spec=CollectiveSenderSpec(buffer_bytes=fleet.buffer_bytes,
                                         num_buffers=fleet.num_buffers, fanout=fleet.refit_fanout),
        control_timeout_s=timeout_s)
    return build_generation(config, frontend_url=url, control_secret=fleet.secret,
                            workers=[WorkerEndpoint(n, u) for n, u in fleet.control_urls.items()])


def _push(generation, fleet, state: dict[str, Any], host: str,
          timeout_s: float) -> tuple[dict[str, int], float]:
    from rollout_fleet.adapters.collective import TrainerRefitSession
    from rollout_fleet.adapters.collective.transfer import refit_info_of
    from rollout_fleet.adapters.shared import free_port

    started = time.monotonic()
    # Every worker checks names, shapes and dtypes against its engine: nothing moves on a mismatch.
    info = generation.prepare_refit_info(
        {t.name: (t.shape, t.dtype) for t in refit_info_of(state).tensors})
    port = free_port(host)
    world_size = 1 + generation.get_inference_world_size()
    joining = generation.init_collective(host, port, world_size, train_world_size=1)
    session = TrainerRefitSession(host, port, 0, world_size, backend=fleet.collective_backend,
                                  timeout_s=timeout_s, spec=generation.get_collective_sender_spec())
    try:
        _wait_all(joining, timeout_s, "init_collective")
        updating = generation.update_weights_from_collective()
        session.send_state_dict(state, info)
        _wait_all(updating, timeout_s, "update_weights")
    finally:
        session.close()
    if generation.invalidate_kv_cache() is not True:
        raise RolloutFleetError("the weights were loaded but a worker's cache was not invalidated")
    return generation.get_weight_versions(), time.monotonic() - started


def _wait_all(futures: list, timeout_s: float, step: str) -> None:
    for future in futures:
        try:
            future.result(timeout=timeout_s)
        except TimeoutError:
            raise RolloutFleetError(f"{step} did not finish on every worker within "
                                    f"{timeout_s:.0f} s") from None

