"""`rollout-fleet demo`, run as CI and a user run it, judged by the demo.json it writes."""

from __future__ import annotations

import json

import pytest

from tests.support.net import in_private_netns
from tests.cli.conftest import assert_one_line_error, run_cli


def test_the_in_memory_demo_refits_every_worker_and_serves_the_new_weights(tmp_path):
    result = run_cli("demo", "--in-memory", "--out", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((tmp_path / "demo.json").read_text())
    assert figures["weight_versions"] == {"worker-0": 1, "worker-1": 1}
    assert figures["before"]["weight_versions"] == [0]
    assert figures["after"]["weight_versions"] == [1]
    for batch in (figures["before"], figures["after"]):
        assert batch["rollouts"] == 32 and batch["tokens"] > 0
        assert 0.0 <= batch["mean_reward"] <= 1.0
    # The seed-1 weights change what is generated, so the reward moves.
    assert figures["before"]["mean_reward"] != figures["after"]["mean_reward"]


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.dynamo
def test_the_ci_demo_refits_every_worker_each_step_then_runs_one_step_off_policy(tmp_path):
    """The short form CI runs, then (--then-async) two steps one step off-policy with keep
    refits on the same fleet, continuing from its weights: one fleet start for both loops."""
    if not in_private_netns():
        pytest.fail("the demo starts a local Ray cluster: run it inside `unshare -n`")
    result = run_cli("demo", "--ci", "--then-async", "--quiet", "--out", tmp_path, timeout_s=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    figures = json.loads((tmp_path / "demo.json").read_text())
    meta, steps = figures["meta"], figures["steps"]
    assert meta["asynchronous"] is False
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["weight_versions"] for s in steps] == [[1, 1], [2, 2]]
    for step in steps:
        assert 0.0 <= step["mismatch_mean"] <= step["mismatch_max"] <= meta["mismatch_bound"]
        assert 0.0 <= step["mean_reward"] <= 1.0
        assert step["rollouts_per_s"] > 0 and step["tokens_per_s"] > 0 and step["refit_s"] > 0
    assert (tmp_path / "demo.png").stat().st_size > 0

    assert "async (one step off-policy, keep refits)" in result.stdout
    figures = json.loads((tmp_path / "async" / "demo.json").read_text())
    meta, steps = figures["meta"], figures["steps"]
    assert meta["asynchronous"] is True
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["weight_versions"] for s in steps] == [[3, 3], [4, 4]]
    # Its step 1's batch ran before any refit of this loop: all of it on the trainer's weights.
    assert steps[0]["off_policy_tokens"] == 0.0
    assert steps[0]["mismatch_max"] <= meta["mismatch_bound"]
    for step in steps:
        assert 0.0 <= step["off_policy_tokens"] <= 1.0 and 0.0 <= step["mean_reward"] <= 1.0
        assert step["rollouts_per_s"] > 0 and step["refit_s"] > 0
    assert steps[-1]["loop_rollouts_per_s"] > 0
    assert (tmp_path / "async" / "demo.png").stat().st_size > 0


def test_then_async_is_refused_beside_the_modes_it_does_not_follow(tmp_path):
    for mode in ("--async", "--colocated", "--in-memory"):
        assert_one_line_error(run_cli("demo", "--then-async", mode, "--out", tmp_path),
                              "--then-async", mode)
        assert not (tmp_path / "demo.json").exists()  # refused before anything started


@pytest.mark.vllm
@pytest.mark.dynamo
def test_the_colocated_ci_demo_refits_its_worker_from_the_trainers_own_parameters(tmp_path):
    """The trainer and one vLLM worker on this machine, the trainer's parameters held in its
    sender's shared-memory buffers (``--in-place``): each step's refit is the engine's copy
    out of them (several buckets, none moved by the optimizer's step), the worker serves those
    weights (the mismatch bound holds on the next batch), each step reports the worker's host
    memory, and the CPU run says it does not sleep."""
    result = run_cli("demo", "--colocated", "--in-place", "--ci", "--quiet", "--out", tmp_path,
                     timeout_s=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "sleep between phases: off (vLLM has no sleep mode on the CPU)" in result.stdout
    figures = json.loads((tmp_path / "demo.json").read_text())
    meta, steps = figures["meta"], figures["steps"]
    assert meta["workers"] == 1 and [s["step"] for s in steps] == [1, 2]
    assert [s["weight_versions"] for s in steps] == [[1], [2]]
    for step in steps:
        assert 0.0 <= step["mismatch_mean"] <= step["mismatch_max"] <= meta["mismatch_bound"]
        assert step["refit_buckets"] > 1 and step["refit_s"] > 0
        assert step["refit_moved_tensors"] == 0 and step["worker_host_mib"] > 100
    assert meta["in_place"] is True
    assert "worker host memory (worker and engine core, resident) after each of 2 cycles" \
        in result.stdout
