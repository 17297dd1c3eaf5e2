"""The driver on the head node of the 3-node layout (run inside the head's namespace, as a
trainer would run on a cluster's head): starts the fleet across the nodes, sends rollouts,
refits over gloo, invalidates every cache, and writes what it saw to a JSON file that the test
checks. Its fleet is always shut down before it exits.

    python tests/nodes/head_driver.py CONFIG.json OUT.json
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.driver.conftest import collect, mixed_batch  # noqa: E402
from tests.support.nodes import listeners_of_processes  # noqa: E402

PROMPTS, PROMPT_SEED = 64, 11


def main(config_path: str, out_path: str) -> int:
    import ray

    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet, call_control

    config = parse_config(json.loads(Path(config_path).read_text()), source=config_path)
    report: dict = {}
    fleet = Fleet.start(config)
    try:
        report["driver_node_id"] = ray.get_runtime_context().get_node_id()
        report["frontend_url"] = fleet.frontend_url
        report["workers"] = [{"name": w.name, "node_ip": w.node_ip, "node_id": w.node_id,
                              "pid": w.pid, "netns": _netns(w.pid),
                              "control_url": fleet.control_url(w)} for w in fleet.workers]
        pids = {"frontend": fleet.frontend.process.pid, "etcd": fleet.etcd.process.pid,
                **{w.name: w.pid for w in fleet.workers}}
        report["listeners"] = {name: listeners_of_processes([pid]) for name, pid in pids.items()}

        generation = fleet.generation()
        try:
            report["before"] = _rollouts(generation)
            report["served"] = {name: call_control(url, "stats", fleet.secret)["served"]
                                for name, url in fleet.control_urls.items()}
            report["refit_versions"] = _refit(fleet, generation)
            report["after"] = _rollouts(generation)
            resets = _cache_resets(fleet)
            report["invalidated"] = generation.invalidate_kv_cache()
            report["cache_resets"] = {"before": resets, "after": _cache_resets(fleet)}
        finally:
            generation.shutdown()
    finally:
        fleet.shutdown()
    Path(out_path).write_text(json.dumps(report))
    return 0


def _rollouts(generation) -> dict[int, dict]:
    _prompts, data = mixed_batch(PROMPTS, seed=PROMPT_SEED)
    pairs = asyncio.run(collect(generation, data, greedy=True))
    out = {}
    for index, sample in pairs:
        start = int(data["input_lengths"][index])
        length = int(sample["generation_lengths"][0])
        out[index] = {"tokens": sample["output_ids"][0, start:start + length].tolist(),
                      "logprobs": sample["logprobs"][0, start:start + length].tolist(),
                      "versions": sorted(set(sample["weight_versions"][0, start:start + length]
                                             .tolist()))}
    return out


def _refit(fleet, generation) -> dict[str, int]:
    """The seed-1 weights from a trainer rank 0 here on the head, to every worker over gloo."""
    import ray
    import torch

    from rollout_fleet.adapters.collective import TrainerRefitSession
    from rollout_fleet.adapters.collective.trainer import refit_info_of
    from rollout_fleet.adapters.memory.engine import TinyBigramModel
    from rollout_fleet.adapters.shared import free_port

    state = {name: torch.tensor(matrix, dtype=torch.float32)
             for name, matrix in TinyBigramModel.from_seed(1).state_dict().items()}
    info = generation.prepare_refit_info({t.name: (t.shape, t.dtype)
                                          for t in refit_info_of(state).tensors})
    host = fleet.config.bind_host  # the trainer's end of the group: the head's cluster address
    port = free_port(host)
    world_size = 1 + generation.get_inference_world_size()
    joining = generation.init_collective(host, port, world_size, train_world_size=1)
    session = TrainerRefitSession(host, port, 0, world_size, backend="gloo", timeout_s=60,
                                  spec=generation.get_collective_sender_spec())
    try:
        ray.get(joining, timeout=60)  # the driver is a Ray driver here: futures are ObjectRefs
        updating = generation.update_weights_from_collective()
        session.send_state_dict(state, info)
        ray.get(updating, timeout=60)
    finally:
        session.close()
    return generation.get_weight_versions()


def _cache_resets(fleet) -> dict[str, int]:
    from rollout_fleet.wiring.fleet import call_control

    return {name: call_control(url, "engine_stats", fleet.secret)["cache_resets"]
            for name, url in fleet.control_urls.items()}


def _netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
