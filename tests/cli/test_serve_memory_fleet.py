"""End to end on a real fleet (2 memory-engine workers on Ray, the real Dynamo frontend, the
fleet's door): `serve` in a subprocess, `generate`, `sleep` / `wake` and `refit` through its
fleet file; the URL `serve` prints is the door's, which answers `generate`'s greedy tokens and
whose dead processes `serve` replaces; then Ctrl-C (SIGINT) stops everything: no process of the
fleet left, no port still listening."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.support.net import in_private_netns
from tests.cli.conftest import (
    assert_one_line_error, memory_fleet_toml, run_cli, start_serve,
)
from tests.driver.conftest import engine_answers
from tests.support.lost_worker import kill_memory_engine
from tests.support.processes import leftover_processes, stop_child

MAX_MODEL_LEN, MAX_NEW = 128, 12
PROMPTS = [[3, 4, 5], [7], [10, 11, 12, 13, 14], [20, 21]]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A running `rollout-fleet serve` and its fleet file."""
    if not in_private_netns():
        pytest.fail("this tier starts a local Ray cluster (it binds 0.0.0.0): run it inside "
                    "`unshare -n` (scripts/test.sh does)")
    root = tmp_path_factory.mktemp("cli-fleet")
    config = memory_fleet_toml(root, workers=2, max_model_len=MAX_MODEL_LEN,
                               max_new_tokens=MAX_NEW, extra="replace_lost_workers = true")
    log = root / "serve.log"
    process = start_serve(config, log)
    fleet_file = root / "run" / "fleet.json"
    yield process, fleet_file, log
    stop_child(process, sig=signal.SIGINT, timeout_s=60)  # a no-op when the test stopped it


def _generate(tmp_path, fleet_file, prompts, *extra):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "results.jsonl"
    args = ("generate", "--fleet-file", fleet_file, "--prompts", path, "--out", out, "--greedy",
            *extra)
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def _generate_lines(tmp_path, fleet_file, prompts):
    """``generate`` that may fail: (its output lines, the finished command)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "results.jsonl"
    result = run_cli("generate", "--fleet-file", fleet_file, "--prompts", path, "--out", out,
                     "--greedy")
    return [json.loads(line) for line in out.read_text().splitlines()], result


def _token_prompts():
    return [{"prompt_token_ids": p, "id": f"p{i}"} for i, p in enumerate(PROMPTS)]


def _memory_checkpoint(folder: Path, seed: int, rows: int | None = None) -> Path:
    import torch
    from safetensors.torch import save_file

    from rollout_fleet.adapters.memory.engine import TinyBigramModel

    folder.mkdir(parents=True)
    state = {name: torch.tensor(matrix, dtype=torch.float32)[:rows]
             for name, matrix in TinyBigramModel.from_seed(seed).state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def test_sleep_refuses_rollouts_with_the_workers_message_and_wake_serves_as_before(fleet, tmp_path):
    """Runs before the Ctrl-C test below (the module's fleet is shared); leaves it awake."""
    _process, fleet_file, _log = fleet
    (tmp_path / "a").mkdir()
    before = _generate(tmp_path / "a", fleet_file, _token_prompts())
    try:
        asleep = run_cli("sleep", "--fleet-file", fleet_file, "--level", "1")
        assert asleep.returncode == 0, asleep.stderr[-3000:]
        assert "worker-0: asleep (level 1; freed: kv_cache, weights)" in asleep.stdout
        assert "worker-1: asleep (level 1" in asleep.stdout
        again = run_cli("sleep", "--fleet-file", fleet_file, "--level", "1")
        assert again.stdout.count("(unchanged)") == 2, again.stdout
        (tmp_path / "s").mkdir()
        lines, refused = _generate_lines(tmp_path / "s", fleet_file, _token_prompts())
        assert refused.returncode == 2
        assert all("HTTP 503: worker worker-" in line["error"] for line in lines), lines
        assert "is asleep (level 1); the trainer wakes it with prepare_for_generation / " \
               "rollout-fleet wake" in refused.stderr, refused.stderr[-3000:]
    finally:
        woke = run_cli("wake", "--fleet-file", fleet_file)
    assert woke.returncode == 0, woke.stderr[-3000:]
    assert "worker-0: awake, serving" in woke.stdout and "worker-1: awake, serving" in woke.stdout
    (tmp_path / "b").mkdir()
    after = _generate(tmp_path / "b", fleet_file, _token_prompts())
    assert [(r["token_ids"], r["logprobs"]) for r in after] == \
        [(r["token_ids"], r["logprobs"]) for r in before]


def test_serve_generate_refit_and_stop_on_ctrl_c(fleet, tmp_path):
    process, fleet_file, log = fleet
    served = json.loads(fleet_file.read_text())
    assert fleet_file.stat().st_mode & 0o777 == 0o600
    assert served["frontend_url"] in log.read_text()
    for url in served["control_urls"].values():
        assert url in log.read_text()

    # generate: the fleet's greedy answers are the memory engine's own (seed 0)
    want = engine_answers(PROMPTS, max_new_tokens=MAX_NEW, max_model_len=MAX_MODEL_LEN, seed=0)
    (tmp_path / "a").mkdir()
    before = _generate(tmp_path / "a", fleet_file, _token_prompts())
    assert [r["id"] for r in before] == ["p0", "p1", "p2", "p3"]
    for result, answer in zip(before, want):
        assert result["token_ids"] == list(answer.token_ids)
        assert result["logprobs"] == pytest.approx(list(answer.logprobs), abs=1e-9)
        assert result["finish_reason"] == answer.finish_reason.value
    # --no-logprobs: the same tokens, no logprobs asked of the engine, null in each line
    (tmp_path / "n").mkdir()
    bare = _generate(tmp_path / "n", fleet_file, _token_prompts(), "--no-logprobs")
    assert [r["token_ids"] for r in bare] == [r["token_ids"] for r in before]
    assert [r["logprobs"] for r in bare] == [None] * len(before)

    # the URL serve prints is the door's: the same greedy tokens and logprobs as `generate`
    door_url = _the_door(served, log)
    for prompt, result in zip(PROMPTS, before):
        answer = httpx.post(f"{door_url}/inference/v1/generate", timeout=60, json={
            "token_ids": prompt, "sampling_params": {"max_tokens": MAX_NEW, "temperature": 0,
                                                     "logprobs": 0}})
        assert answer.status_code == 200, answer.text
        (choice,) = answer.json()["choices"]
        assert choice["token_ids"] == result["token_ids"]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
            result["logprobs"], abs=1e-6)
    # a door process that dies: serve replaces it and lists the new one in the fleet file
    dead = served["processes"]["door-0"]
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while f"door process(es) [{dead}] died; replaced by" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while json.loads(fleet_file.read_text())["processes"]["door-0"] == dead:
        assert time.monotonic() < deadline, fleet_file.read_text()
        time.sleep(0.2)
    replaced = json.loads(fleet_file.read_text())["processes"]
    assert os.path.exists(f"/proc/{replaced['door-0']}")
    assert httpx.get(f"{door_url}/health", timeout=30).status_code == 200

    # text prompts through the model folder's tokenizer, the text of each answer back
    tokenizer_dir = fleet_file.parent / "model-memory"
    (tmp_path / "t").mkdir()
    texts = _generate(tmp_path / "t", fleet_file, [{"text": "ab"}, {"text": "the", "max_new_tokens": 3}],
                      "--tokenizer", tokenizer_dir)
    assert [r["id"] for r in texts] == ["0", "1"]
    assert len(texts[1]["token_ids"]) <= 3
    assert all(isinstance(r["text"], str) and len(r["logprobs"]) == len(r["token_ids"])
               for r in texts)

    # refit with wrong shapes: refused before any transfer, the fleet keeps its weights
    bad = _memory_checkpoint(tmp_path / "bad", seed=1, rows=3)
    assert_one_line_error(run_cli("refit", "--fleet-file", fleet_file, "--checkpoint", bad),
                          "prepare_refit_info", "shape", "embed.weight")
    # refit with the seed-1 weights: every worker at version 1, greedy answers are seed 1's
    good = _memory_checkpoint(tmp_path / "good", seed=1)
    result = run_cli("refit", "--fleet-file", fleet_file, "--checkpoint", good)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "worker-0: weight version 1" in result.stdout
    assert "worker-1: weight version 1" in result.stdout
    (tmp_path / "b").mkdir()
    after = _generate(tmp_path / "b", fleet_file, _token_prompts())
    want_1 = engine_answers(PROMPTS, max_new_tokens=MAX_NEW, max_model_len=MAX_MODEL_LEN, seed=1)
    assert [r["token_ids"] for r in after] == [list(a.token_ids) for a in want_1]
    assert [r["token_ids"] for r in after] != [r["token_ids"] for r in before]
    assert {r["weight_version"] for r in after} == {1}
    # the memory engine reloads nothing from disk: refused naming it, the weights stay
    assert_one_line_error(run_cli("refit", "--fleet-file", fleet_file, "--from-disk", good),
                          "check_checkpoint", "the memory engine does not reload")

    # a prompt the engine refuses: every other result is written, one error line for it, exit 2
    (tmp_path / "e").mkdir()
    with_a_bad_one = [*_token_prompts()[:2], {"prompt_token_ids": [3, 999], "id": "bad"},
                      *_token_prompts()[2:]]
    lines, failed = _generate_lines(tmp_path / "e", fleet_file, with_a_bad_one)
    assert failed.returncode == 2
    assert "1 of 5 prompts failed" in failed.stderr and "'bad' (index 2)" in failed.stderr
    assert [line["id"] for line in lines] == ["p0", "p1", "bad", "p2", "p3"]
    assert lines[2]["index"] == 2 and "HTTP 400" in lines[2]["error"] and "token_ids" not in lines[2]
    assert [line["token_ids"] for line in lines[:2] + lines[3:]] == [list(a.token_ids) for a in want_1]

    # a worker whose engine dies: serve says so in its log, naming the worker and why
    kill_memory_engine(served["control_urls"]["worker-0"], served["secret"])  # same namespace
    deadline = time.monotonic() + 30
    while "worker-0 lost" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "warning: worker-0 lost, out of the frontend's routing: EngineDead: the memory engine " \
           "died" in log.read_text(), log.read_text()[-3000:]

    # replace_lost_workers: a replacement joins; the fleet file lists the live workers, and the
    # next refit forms its group with them and loads the current weights on the replacement
    deadline = time.monotonic() + 120
    joined = "warning: worker-2 joined; it serves once the next refit"
    while joined not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert joined in log.read_text(), log.read_text()[-3000:]
    assert "worker-2 lost" not in log.read_text()  # while it started, it was not taken for lost
    rejoined = json.loads(fleet_file.read_text())
    assert sorted(rejoined["control_urls"]) == ["worker-1", "worker-2"]
    result = run_cli("refit", "--fleet-file", fleet_file,
                     "--checkpoint", _memory_checkpoint(tmp_path / "good2", seed=2))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "worker-1: weight version 2" in result.stdout
    assert "worker-2: weight version 2" in result.stdout  # the fleet's version, not 0 + 1
    (tmp_path / "r").mkdir()
    want_2 = engine_answers(PROMPTS, max_new_tokens=MAX_NEW, max_model_len=MAX_MODEL_LEN, seed=2)
    again = _generate(tmp_path / "r", fleet_file, _token_prompts())
    assert [r["token_ids"] for r in again] == [list(a.token_ids) for a in want_2]

    # Ctrl-C: serve stops the fleet and exits 0; nothing of it is left
    ports = [_port(served["frontend_url"]), _port(door_url)] + [_port(u) for u in (
        *served["control_urls"].values(), *rejoined["control_urls"].values())]
    process.send_signal(signal.SIGINT)
    assert process.wait(60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "fleet stopped" in text and "Traceback" not in text, text[-3000:]
    assert not fleet_file.exists()
    groups = [process.pid, *served["processes"].values(), *replaced.values(),
              *rejoined["processes"].values()]
    assert leftover_processes(groups, wait_s=15) == []
    assert [p for p in ports if _listening(p)] == []


def _the_door(served: dict, log: Path) -> str:
    """The fleet's URL as serve prints it and the fleet file names it; its door processes
    (min(4, cores) of them) are in the file's process list."""
    door_url = served["door_url"]
    assert door_url.startswith("http://127.0.0.1:") and door_url != served["frontend_url"]
    assert f"url: {door_url} (OpenAI base URL {door_url}/v1; " in log.read_text()
    assert f"frontend (internal: the driver's rollouts): {served['frontend_url']}" in \
        log.read_text()
    doors = sorted(name for name in served["processes"] if name.startswith("door-"))
    assert doors == [f"door-{i}" for i in range(min(4, os.cpu_count() or 1))], doors
    assert httpx.get(f"{door_url}/health", timeout=30).status_code == 200
    return door_url


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0
