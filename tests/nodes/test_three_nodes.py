"""A fleet across 3 nodes of a real Ray cluster, on one machine: 3 network namespaces joined by
a bridge (support/node_layout.py), `ray start` on each, etcd and the frontend on the head's
address, one memory-engine worker on each of the other two nodes. The driver runs on the head
(tests/nodes/head_driver.py); rollouts, a gloo refit and a cache flush all cross the bridge.
Last, node 3 is lost (every process in its namespace killed while its worker holds rollouts)
in the middle of a batch."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.driver.conftest import engine_answers, mixed_batch
from tests.nodes.head_driver import PROMPT_SEED, PROMPTS
from support.node_layout import WORKER_RESOURCE, NodeLayout

pytestmark = pytest.mark.ray
HERE = Path(__file__).parent
MAX_MODEL_LEN, MAX_NEW = 128, 12


@pytest.fixture(scope="module")
def run():
    """The layout, one driver run on its head, and what the driver reported; then every
    process of every node is stopped, and nothing may be left."""
    # A short root of its own: Ray's sockets live under each node's temp dir, and a Unix
    # socket's path may not pass 107 bytes (pytest-xdist's temp folders are one level deeper).
    root = Path(tempfile.mkdtemp(prefix="rf-nodes-"))
    try:
        # Two worker slots per worker node, spread: after node 3 is lost, Ray places its worker's
        # bundle anew on node 2, where the replacement starts.
        layout = NodeLayout(root, count=3, worker_cpus=2, worker_slots=2).start()
        inodes = {node.name: node.inode for node in layout.nodes}
        try:
            config = {
                # a token takes 10 ms: rollouts are still in flight when the node is lost
                "engine": {"kind": "memory", "seed": 0, "context_length": MAX_MODEL_LEN,
                           "token_delay_s": 0.01, "test_controls": True},
                # the frontend tries a lost worker until the fleet sees it lost and takes it out of
                # etcd (about a second here): retries outlast that
                "retry": {"max_attempts": 10, "base_delay_s": 0.2},
                "served_model_name": "mem", "num_workers": 2, "max_model_len": MAX_MODEL_LEN,
                "max_new_tokens": MAX_NEW, "ray_address": layout.ray_address,
                "bind_host": layout.head.address, "discovery": "etcd",
                "resources_per_worker": {WORKER_RESOURCE: 1}, "run_dir": str(root / "run"),
                "placement_strategy": "SPREAD",
                "refit": {"buffer_bytes": 65536}, "timeouts": {"start_s": 120}}
            (root / "fleet.json").write_text(json.dumps(config))
            out, log = root / "report.json", root / "driver.log"
            lost = layout.nodes[2]  # 10.77.0.3
            code = layout.run_on(1, [sys.executable, str(HERE / "head_driver.py"),
                                     str(root / "fleet.json"), str(out), str(lost.inode)],
                                 timeout_s=420, log_path=log)
            assert code == 0, f"the head's driver failed:\n{log.read_text()[-4000:]}"
            report = json.loads(out.read_text())
            after_driver = layout.listeners()
        finally:
            stuck = layout.stop()
        assert stuck == [], f"processes of the layout would not stop: {stuck}"
        left = [pid for pid in _all_pids() if _netns(pid) in set(inodes.values())]
        assert left == [], f"processes left in the nodes' namespaces: {left}"
        yield report, layout, inodes, after_driver
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_each_worker_runs_on_its_own_node_and_binds_only_that_nodes_address(run):
    report, layout, inodes, _ = run
    workers = report["workers"]
    assert sorted(w["node_ip"] for w in workers) == ["10.77.0.2", "10.77.0.3"]
    for worker in workers:
        node = layout.node_of(worker["node_ip"])
        # the worker process really lives in that node's network namespace ...
        assert worker["netns"] == inodes[node.name], worker
        # ... on the node Ray reports for it, which is not the driver's
        assert worker["node_id"] and worker["node_id"] != report["driver_node_id"]
        # and every server it holds (request plane, system port) is on its own address
        listening = report["listeners"][worker["name"]]
        assert listening, f"{worker['name']} listens nowhere"
        assert {address for address, _port in listening} == {worker["node_ip"]}, listening
        assert worker["control_url"].startswith(f"http://{worker['node_ip']}:")
    assert workers[0]["node_id"] != workers[1]["node_id"]
    for name in ("frontend", "etcd"):  # the driver's node, on the head's cluster address
        assert {a for a, _p in report["listeners"][name]} == {"10.77.0.1"}, report["listeners"]
    assert report["frontend_url"].startswith("http://10.77.0.1:")


def test_rollouts_through_the_head_equal_the_engine_and_reach_both_nodes(run):
    report, *_ = run
    prompts, _ = mixed_batch(PROMPTS, seed=PROMPT_SEED)
    _check(report["before"], prompts, seed=0)
    assert all(served > 0 for served in report["served"].values()), report["served"]
    assert sum(report["served"].values()) >= PROMPTS


def test_a_refit_over_gloo_across_the_bridge_loads_the_new_weights_on_both_nodes(run):
    report, *_ = run
    assert report["refit_versions"] == {"worker-0": 1, "worker-1": 1}
    prompts, _ = mixed_batch(PROMPTS, seed=PROMPT_SEED)
    _check(report["after"], prompts, seed=1)
    assert all(r["versions"] == [1] for r in report["after"].values())
    assert [r["tokens"] for r in report["after"].values()] != \
        [r["tokens"] for r in report["before"].values()]


def test_controls_from_another_node_without_the_secret_are_refused(run):
    """The driver's node asks each worker (on its own node) for controls with no secret and a
    wrong one: every answer is a refusal, and the later refit and flush (with the secret) work."""
    report, *_ = run
    assert set(report["strangers"]) == {"worker-0", "worker-1"}
    for worker, answers in report["strangers"].items():
        assert len(answers) == 6
        for call, answer in answers.items():
            assert answer != "ok" and "refused" in answer, (worker, call, answer)


def test_cache_invalidation_reaches_the_worker_on_each_node(run):
    report, *_ = run
    assert report["invalidated"] is True
    resets = report["cache_resets"]
    assert {name: resets["after"][name] - resets["before"][name] for name in resets["after"]} \
        == {"worker-0": 1, "worker-1": 1}


def test_a_lost_node_mid_batch_loses_and_repeats_no_rollout_and_is_reported(run):
    """Every process of node 3 (Ray's daemons, the worker's supervisor, the worker) killed while
    its worker holds rollouts: each rollout of the batch still comes back once, equal to the
    engine's answer (those cut off are retried on the surviving node), and the fleet names the
    lost worker; the driver leaves it out of the cache flush after it, which reaches the
    survivor, and the next refit forms its group with the survivor alone."""
    report, layout, *_ = run
    lost = report["lost_node"]
    victim = next(w for w in report["workers"] if w["name"] == lost["worker"])
    assert victim["node_ip"] == "10.77.0.3"
    assert lost.get("in_flight_at_kill", 0) > 0, "the worker held no rollout when its node was lost"
    assert lost["killed"] > 3, "too few processes on the lost node: was it a node?"
    assert lost["errors"] == [], lost["errors"]
    assert sorted(lost["indices"]) == list(range(PROMPTS)), "a rollout lost or repeated"
    prompts, _ = mixed_batch(PROMPTS, seed=PROMPT_SEED)
    _check(lost["rollouts"], prompts, seed=1)  # the refit weights, on the surviving node
    assert lost["dead_workers"] == [lost["worker"]] == list(lost["lost_workers"])
    print(f"\nnode lost -> the fleet reports its worker lost: {lost['reported_lost_after_s']} s")
    # The fleet's driver leaves the lost worker out of later steps: the flush reaches the survivor.
    assert lost["invalidate_after"] == "ok"
    assert lost["workers_after"] == [w["name"] for w in report["workers"] if w["name"] != lost["worker"]]
    # The refit after the loss: a group of the trainer and the survivor, the survivor on v2.
    assert lost["world_size_after"] == 2
    assert lost["refit_after"] == {name: 2 for name in lost["workers_after"]}
    _check(lost["after_refit"], prompts, seed=2)


def test_a_replacement_joins_on_the_surviving_node_and_serves_after_the_next_refit(run):
    """After the loss the fleet scales back up: a replacement worker placed by Ray on the node
    with a slot left, binding that node's address; held until the next refit, which forms the
    group with it (world size 3 again) and sets it to the fleet's version; then it serves."""
    report, layout, inodes, _ = run
    replacement = report["replacement"]
    assert replacement["name"] == "worker-2"
    assert replacement["node_ip"] == "10.77.0.2"
    assert replacement["netns"] == inodes[layout.node_of("10.77.0.2").name]
    assert replacement["held_at_start"] is True
    prompts, _ = mixed_batch(PROMPTS, seed=PROMPT_SEED)
    _check(replacement["while_held"], prompts, seed=2)  # its own seed-0 weights never served
    assert replacement["served_while_held"] == 0
    assert replacement["world_size"] == 3
    survivor = report["lost_node"]["workers_after"][0]
    assert replacement["refit"] == {survivor: 3, "worker-2": 3}
    assert replacement["served_after_refit"] > 0
    _check(replacement["after_refit"], prompts, seed=3)


def test_the_secret_shows_in_no_process_of_any_node_and_no_file_of_the_layout(run):
    """Read while the fleet ran (the replacement included): no command line, no environment
    of any process on any node, no file of the run, Ray's folders or the logs holds it."""
    report, *_ = run
    assert report["secret_leaks"] == []


def _check(served: dict, prompts, *, seed: int) -> None:
    answers = engine_answers(prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_MODEL_LEN, seed=seed)
    assert sorted(int(i) for i in served) == list(range(len(prompts)))
    for index, answer in enumerate(answers):
        got = served[str(index)]
        assert got["tokens"] == list(answer.token_ids), f"prompt {index}"
        # float32 on the wire and in the tensors: equal to the engine's value in float32
        assert got["logprobs"] == pytest.approx(list(answer.logprobs), rel=1e-6, abs=1e-6)


def _all_pids():
    import os

    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _netns(pid: int):
    import os

    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
