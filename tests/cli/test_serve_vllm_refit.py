"""End to end with a real vLLM worker: `serve` a 1-worker vLLM fleet (the tiny model, seed 0);
the URL it prints is the fleet's door, whose token-in answers are `generate`'s greedy tokens;
`refit` it with the seed-1 checkpoint, and `generate` shows the new model's greedy answers;
`refit --from-disk` reloads the same folder in the worker itself (version 2, the same
answers), and refuses a wrong one by name."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import pytest

from tests.support.net import in_private_netns
from tests.cli.conftest import COMMAND, ROOT, assert_one_line_error, cli_env, run_cli
from tests.support.processes import leftover_processes, stop_child

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.dynamo]
PROMPTS = [[5, 17, 80], [200, 31], [44, 45, 46, 47], [300]]


def _greedy(tmp_path, fleet_file, name):
    prompts = tmp_path / f"{name}.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in PROMPTS))
    out = tmp_path / f"{name}-out.jsonl"
    result = run_cli("generate", "--fleet-file", fleet_file, "--prompts", prompts, "--out", out,
                     "--greedy", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_refit_a_vllm_fleet_from_a_checkpoint(tmp_path):
    if not in_private_netns():
        pytest.fail("this test starts a local Ray cluster: run it inside `unshare -n`")
    config = tmp_path / "fleet.json"
    config.write_text(json.dumps({
        "engine": {"kind": "vllm"}, "model": "tiny", "num_workers": 1, "max_model_len": 512,
        "max_new_tokens": 8, "run_dir": str(tmp_path / "run"),
        "refit": {"buffer_bytes": 1 << 20, "num_buffers": 2}, "timeouts": {"start_s": 400}}))
    fleet_file = tmp_path / "fleet-file.json"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [*COMMAND, "serve", "--config", str(config), "--fleet-file", str(fleet_file)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            env=cli_env(), start_new_session=True)
    try:
        seed_1 = tmp_path / "seed-1"  # built while the fleet starts
        built = run_cli("build-tiny-model", seed_1, "--seed", "1", timeout_s=300)
        assert built.returncode == 0, built.stderr[-3000:]
        deadline = time.monotonic() + 420
        while "serving;" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        served = json.loads(fleet_file.read_text())
        before = _greedy(tmp_path, fleet_file, "before")
        assert all(r["weight_version"] == 0 and r["token_ids"] for r in before)
        _door_answers_as_generate(served, log.read_text(), before)

        # a checkpoint of the wrong model is refused before any transfer
        (tmp_path / "wrong").mkdir()
        _truncated_copy(seed_1 / "model.safetensors", tmp_path / "wrong" / "model.safetensors")
        assert_one_line_error(run_cli("refit", "--fleet-file", fleet_file,
                                      "--checkpoint", tmp_path / "wrong"), "prepare_refit_info")
        assert _greedy(tmp_path, fleet_file, "still")  == before

        result = run_cli("refit", "--fleet-file", fleet_file, "--checkpoint", seed_1,
                         timeout_s=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "worker-0: weight version 1" in result.stdout
        after = _greedy(tmp_path, fleet_file, "after")
        assert all(r["weight_version"] == 1 for r in after)
        assert [r["token_ids"] for r in after] != [r["token_ids"] for r in before]
        assert _greedy(tmp_path, fleet_file, "again") == after  # greedy: repeatable

        # from disk: every worker reads the folder itself; a wrong one is refused by name first
        assert_one_line_error(run_cli("refit", "--fleet-file", fleet_file, "--from-disk",
                                      tmp_path / "wrong"), "check_checkpoint", "shape of")
        reloaded = run_cli("refit", "--fleet-file", fleet_file, "--from-disk", seed_1,
                           timeout_s=300)
        assert reloaded.returncode == 0, reloaded.stderr[-3000:]
        assert "worker-0: weight version 2" in reloaded.stdout
        from_disk = _greedy(tmp_path, fleet_file, "from-disk")
        assert all(r["weight_version"] == 2 for r in from_disk)
        assert [r["token_ids"] for r in from_disk] == [r["token_ids"] for r in after]

        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 0, log.read_text()[-3000:]
        assert "Traceback" not in log.read_text()
        assert leftover_processes([process.pid, *served["processes"].values()], wait_s=20) == []
    finally:
        stop_child(process, sig=signal.SIGINT, timeout_s=60)


def _door_answers_as_generate(served, log, results):
    """The URL serve prints, the door's (the frontend internal): its /inference/v1/generate
    gives the greedy tokens and logprobs `generate` got through the driver."""
    door_url = served["door_url"]
    assert f"url: {door_url} (OpenAI base URL {door_url}/v1; " in log
    assert any(name.startswith("door-") for name in served["processes"])
    for prompt, result in zip(PROMPTS, results):
        answer = httpx.post(f"{door_url}/inference/v1/generate", timeout=120, json={
            "token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0,
                                                     "logprobs": 0}})
        assert answer.status_code == 200, answer.text
        (choice,) = answer.json()["choices"]
        assert choice["token_ids"] == result["token_ids"]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
            result["logprobs"], abs=1e-4)


def _truncated_copy(source, target):
    """The same tensor names, one of them a row short."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(source))
    name = sorted(state)[0]
    state[name] = state[name][:-1].contiguous()
    save_file(state, str(target))
