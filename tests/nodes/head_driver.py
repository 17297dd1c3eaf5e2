"""The driver on the head node of the 3-node layout (run inside the head's namespace, as a
trainer would run on a cluster's head): starts the fleet across the nodes, sends rollouts,
refits over gloo, invalidates every cache, then loses a node (every process in the network
namespace ``LOST_NETNS`` killed while its worker holds rollouts) in the middle of a batch, and
writes what it saw to a JSON file that the test checks. Its fleet is always shut down before
it exits.

    python tests/nodes/head_driver.py CONFIG.json OUT.json LOST_NETNS
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.driver.conftest import mixed_batch  # noqa: E402
from support.node_layout import listeners_of_processes  # noqa: E402
from tests.support.trust import secret_leaks  # noqa: E402

PROMPTS, PROMPT_SEED = 64, 11


def main(config_path: str, out_path: str, lost_netns: str) -> int:
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

        report["strangers"] = _stranger_controls(fleet)
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
            report["lost_node"] = _lose_node(fleet, generation, int(lost_netns))
            report["replacement"] = _replace(fleet, generation, report["lost_node"]["worker"])
            # every process on the machine (each node's), every file of the layout's folder
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
            report["secret_leaks"] = secret_leaks(fleet.secret, pids, [Path(config_path).parent])
        finally:
            generation.shutdown()
    finally:
        fleet.shutdown()
    Path(out_path).write_text(json.dumps(report))
    return 0


def _stranger_controls(fleet) -> dict[str, dict[str, str]]:
    """Each worker's answer, from this node (another node than the worker's), to controls sent
    without the secret and with a wrong one: {worker: {control/secret: answer}}."""
    from rollout_fleet.wiring.fleet import call_control

    answers: dict[str, dict[str, str]] = {}
    for name, url in fleet.control_urls.items():
        seen = answers[name] = {}
        for control in ("flush_cache", "weight_version", "update_weights"):
            for label, secret in (("none", None), ("wrong", "not-" + fleet.secret)):
                try:
                    if secret is None:
                        seen[f"{control}/{label}"] = _post_without_secret(url, control)
                    else:
                        call_control(url, control, secret, timeout_s=10)
                        seen[f"{control}/{label}"] = "ok"
                except ValueError as refused:  # the worker's own answer, status error
                    seen[f"{control}/{label}"] = str(refused)
    return answers


def _post_without_secret(control_url: str, control: str) -> str:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{control_url}/engine/control/{control}", data=b"{}",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            data = json.loads(answer.read())
    except urllib.error.HTTPError as refused:  # 401: the secret is missing
        return f"HTTP {refused.code}: {json.loads(refused.read())}"
    return "ok" if data.get("status") == "ok" else str(data)


def _rollouts(generation, into: list | None = None) -> dict[int, dict]:
    """Greedy answers to the test's prompts, {index: answer}; each (index, answer) pair is also
    appended to ``into`` as it comes (repeats kept, and kept when the batch fails)."""
    _prompts, data = mixed_batch(PROMPTS, seed=PROMPT_SEED)
    pairs = [] if into is None else into

    async def gather() -> None:
        async for index, sample in generation.generate_async(data, greedy=True):
            pairs.append((index, _answer(data, index, sample)))

    asyncio.run(gather())
    return dict(pairs)


def _answer(data, index: int, sample) -> dict:
    start = int(data["input_lengths"][index])
    length = int(sample["generation_lengths"][0])
    return {"tokens": sample["output_ids"][0, start:start + length].tolist(),
            "logprobs": sample["logprobs"][0, start:start + length].tolist(),
            "versions": sorted(set(sample["weight_versions"][0, start:start + length].tolist()))}


def _refit(fleet, generation, seed: int = 1) -> dict[str, int]:
    """The ``seed`` model's weights from a trainer rank 0 here on the head, to every worker the
    driver knows (the live ones) over gloo."""
    import ray
    import torch

    from rollout_fleet.adapters.collective import TrainerRefitSession
    from rollout_fleet.adapters.collective.transfer import refit_info_of
    from rollout_fleet.adapters.memory.engine import TinyBigramModel
    from rollout_fleet.adapters.shared import free_port

    state = {name: torch.tensor(matrix, dtype=torch.float32)
             for name, matrix in TinyBigramModel.from_seed(seed).state_dict().items()}
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


def _lose_node(fleet, generation, netns: int) -> dict:
    """A batch during which every process of one worker node is killed, once its worker holds
    rollouts: what the batch returned, and what the fleet then says."""
    from rollout_fleet.wiring.fleet import call_control

    victim = next(w for w in fleet.workers if _netns(w.pid) == netns)
    seen: dict = {"worker": victim.name}

    def kill_when_busy() -> None:
        url, deadline = fleet.control_url(victim), time.monotonic() + 60
        while time.monotonic() < deadline:
            in_flight = call_control(url, "stats", fleet.secret)["in_flight"]
            if in_flight > 0:
                seen["in_flight_at_kill"] = in_flight
                seen["killed"] = _kill_namespace(netns)
                killed_at = time.monotonic()
                while victim.name not in fleet.dead_workers() and time.monotonic() < deadline + 60:
                    time.sleep(0.05)
                seen["reported_lost_after_s"] = round(time.monotonic() - killed_at, 2)
                return

    killer = threading.Thread(target=kill_when_busy, daemon=True)
    killer.start()
    pairs: list = []
    seen["errors"] = []
    try:
        _rollouts(generation, into=pairs)
    except Exception as exc:  # noqa: BLE001 - a clear error is reported, not hidden
        seen["errors"].append(f"{type(exc).__name__}: {exc}")
    seen["indices"] = [index for index, _ in pairs]  # in arrival order, repeats kept
    seen["rollouts"] = dict(pairs)
    killer.join(60)
    seen["dead_workers"] = fleet.dead_workers()
    seen["lost_workers"] = fleet.lost_workers()
    try:  # the fleet's driver leaves the lost worker out: the survivors' caches are flushed
        generation.invalidate_kv_cache()
        seen["invalidate_after"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported for the test to judge
        seen["invalidate_after"] = f"{type(exc).__name__}: {exc}"
    seen["workers_after"] = list(generation.worker_ids)
    # The next refit forms its group with the survivor alone (world size 2) and succeeds.
    seen["world_size_after"] = 1 + generation.get_inference_world_size()
    seen["refit_after"] = _refit(fleet, generation, seed=2)
    seen["after_refit"] = _rollouts(generation)
    return seen


def _replace(fleet, generation, lost: str) -> dict:
    """A replacement for the lost worker (on the node with a slot left): held until the next
    refit, which forms the group with it and gives it the fleet's version; then it serves."""
    from rollout_fleet.wiring.fleet import call_control

    worker = fleet.add_worker(replacing=lost)
    url = fleet.control_url(worker)
    seen: dict = {"name": worker.name, "node_ip": worker.node_ip, "netns": _netns(worker.pid),
                  "held_at_start": call_control(url, "stats", fleet.secret)["held"]}
    seen["while_held"] = _rollouts(generation)  # on the survivor's weights (seed 2) alone
    seen["served_while_held"] = call_control(url, "stats", fleet.secret)["served"]
    seen["world_size"] = 1 + generation.get_inference_world_size()
    seen["refit"] = _refit(fleet, generation, seed=3)
    deadline = time.monotonic() + 60  # the frontend tries a worker it kept away again in ~5 s
    while call_control(url, "stats", fleet.secret)["served"] == 0 and time.monotonic() < deadline:
        seen["after_refit"] = _rollouts(generation)
    seen["after_refit"] = _rollouts(generation)
    seen["served_after_refit"] = call_control(url, "stats", fleet.secret)["served"]
    return seen


def _kill_namespace(netns: int) -> int:
    """SIGKILL every process of one node: the machine is gone, Ray's daemons and all."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _netns_or_none(int(p)) == netns]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def _netns_or_none(pid: int) -> int | None:
    try:
        return _netns(pid)
    except OSError:
        return None


def _cache_resets(fleet) -> dict[str, int]:
    from rollout_fleet.wiring.fleet import call_control

    return {name: call_control(url, "engine_stats", fleet.secret)["cache_resets"]
            for name, url in fleet.control_urls.items()}


def _netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
