"""The fleet runs in its user's own network namespace: no `unshare`, no `nsenter`, no root.

The test makes a namespace that looks like a host's (loopback plus a second interface, so
loopback is not the only one) and runs each command in it as a user's shell would: `serve` in
one process, `generate` and `refit` in others, then NeMo-RL's drop-in from a process whose own
Ray runs there. Every process of the fleet stays in that namespace (the product enters none of
its own), what the project itself listens on is loopback, and `serve` says once what binds
every interface (a local Ray's daemons)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.cli.conftest import COMMAND, ROOT, cli_env, memory_fleet_toml, start_serve
from tests.cli.test_serve_memory_fleet import PROMPTS, _memory_checkpoint, _token_prompts
from tests.driver.conftest import engine_answers
from tests.support.net import non_loopback_listeners
from tests.support.processes import leftover_processes, stop_child

pytestmark = [pytest.mark.ray, pytest.mark.dynamo]
MAX_MODEL_LEN, MAX_NEW = 128, 12
# A second interface (a veth pair whose both ends stay in the namespace this test makes): an
# address that is not loopback, and no route to anywhere else.
_SETUP = ("ip link set lo up && ip link add rf-host0 type veth peer name rf-host1 && "
          "ip addr add 10.79.0.1/24 dev rf-host0 && ip link set rf-host0 up && "
          "ip link set rf-host1 up && echo ready && exec sleep 900")


@pytest.fixture
def host_like_namespace():
    """A network namespace with loopback and one more interface; yields a command prefix that
    runs a command in it (the harness enters it; the product never does)."""
    holder = subprocess.Popen(["unshare", "-n", "--", "sh", "-c", _SETUP], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if holder.stdout.readline().strip() != "ready":
            pytest.fail(f"could not make a network namespace (needs root and `ip`): "
                        f"{holder.stderr.read()[-2000:]}")
        yield holder.pid, ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"]
    finally:
        stop_child(holder, sig=signal.SIGKILL)


def _netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _in_namespace(enter, *args, timeout_s=120):
    return subprocess.run([*enter, *COMMAND, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, env=cli_env(), stdin=subprocess.DEVNULL)


def test_serve_generate_and_refit_from_plain_shells(host_like_namespace, tmp_path):
    holder, enter = host_like_namespace
    config = memory_fleet_toml(tmp_path, workers=1, max_model_len=MAX_MODEL_LEN,
                               max_new_tokens=MAX_NEW)
    log = tmp_path / "serve.log"
    process = start_serve(config, log, prefix=tuple(enter))
    fleet_file = tmp_path / "run" / "fleet.json"
    try:
        served = json.loads(fleet_file.read_text())
        # every process of the fleet lives in the user's namespace: none was moved to another
        fleet_pids = [process.pid, *served["processes"].values()]
        assert {pid: _netns(pid) for pid in fleet_pids} == {pid: _netns(holder)
                                                            for pid in fleet_pids}
        assert non_loopback_listeners(served["processes"].values()) == []
        text = log.read_text()
        assert "the local Ray cluster's daemons listen on every interface (Ray's token " \
               "authentication guards them)" in text, text[-3000:]
        assert text.count("listen on every interface") == 1, text[-3000:]

        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in _token_prompts()))
        out = tmp_path / "before.jsonl"
        result = _in_namespace(enter, "generate", "--fleet-file", fleet_file, "--prompts",
                               prompts, "--out", out, "--greedy")
        assert result.returncode == 0, result.stderr[-3000:]
        want = engine_answers(PROMPTS, max_new_tokens=MAX_NEW, max_model_len=MAX_MODEL_LEN)
        assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == \
            [list(a.token_ids) for a in want]

        result = _in_namespace(enter, "refit", "--fleet-file", fleet_file, "--checkpoint",
                               _memory_checkpoint(tmp_path / "seed1", seed=1))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "worker-0: weight version 1" in result.stdout
        out = tmp_path / "after.jsonl"
        result = _in_namespace(enter, "generate", "--fleet-file", fleet_file, "--prompts",
                               prompts, "--out", out, "--greedy")
        assert result.returncode == 0, result.stderr[-3000:]
        want = engine_answers(PROMPTS, max_new_tokens=MAX_NEW, max_model_len=MAX_MODEL_LEN,
                              seed=1)
        assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == \
            [list(a.token_ids) for a in want]
    finally:
        assert stop_child(process, sig=signal.SIGINT, timeout_s=60) == 0, log.read_text()[-3000:]
    assert leftover_processes([process.pid, *served["processes"].values()], wait_s=15) == []


_DROPIN_CHILD = """
import json, sys
import ray
from rollout_fleet.adapters.memory.model_folder import write_model_folder
from rollout_fleet.wiring.nemo_rl import DynamoGeneration
from tests.driver.conftest import collect, mixed_batch
from tests.fleet.test_nemo_rl_dropin import nemo_rl_config, own_answers
import asyncio

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # the trainer's own Ray
folder = write_model_folder(sys.argv[1], context_length=128)
generation = DynamoGeneration(None, nemo_rl_config(folder))
try:
    prompts, batch = mixed_batch(4, max_len=12)
    samples = dict(asyncio.run(collect(generation, batch)))
    got = [samples[i]["output_ids"][0, len(p):].tolist() for i, p in enumerate(prompts)]
    want = [list(a.token_ids) for a in own_answers(prompts)]
    print(json.dumps({"equal": got == want, "got": got, "want": want}))
finally:
    generation.shutdown()
    ray.shutdown()
"""


def test_nemo_rl_dropin_under_the_trainers_own_ray(host_like_namespace, tmp_path):
    """As in a NeMo-RL run: the trainer started Ray on its host's network, then builds the
    drop-in, which starts its fleet on that Ray."""
    _holder, enter = host_like_namespace
    child = subprocess.Popen([*enter, sys.executable, "-c", _DROPIN_CHILD, str(tmp_path / "model")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env=cli_env(), stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=300)
    finally:
        stop_child(child)
    assert child.returncode == 0, stderr[-3000:]
    answer = json.loads(stdout.strip().splitlines()[-1])
    assert answer["equal"], answer
    assert leftover_processes([child.pid], wait_s=15) == []
