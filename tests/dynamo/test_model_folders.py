"""Models from outside: a folder without a chat template serves completions (chat answers a
4xx), and a model the frontend cannot materialise ends the wait as soon as the frontend gives
up on it, with the frontend's own one-line reason (real frontend, real worker processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from rollout_fleet.adapters.dynamo import ModelRejected
from rollout_fleet.adapters.memory.model_folder import write_model_folder
from tests.dynamo.conftest import start_worker_process, worker_config
from tests.support import free_port, leftover_processes, stop_child

pytestmark = pytest.mark.dynamo

WAIT_S = 300  # the wait allowed; ModelRejected (not a timeout) shows it ended on the reason


def model_folder(path: Path, chat_template: str | None) -> Path:
    folder = write_model_folder(path)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if chat_template is None:
        config.pop("chat_template")
    else:
        config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config))
    return folder


def worker_on_folder(fleet, name: str, folder: Path):
    config = {**worker_config(fleet.run_dir, free_port(), name), "model_path": str(folder),
              "namespace": f"test-{name}"}
    return start_worker_process(fleet.run_dir, config, name)


@pytest.fixture
def serving(fleet):
    started = []

    def start(name: str, folder: Path):
        started.append(worker_on_folder(fleet, name, folder))
        return started[-1]

    yield start
    for worker in started:
        stop_child(worker)
    assert leftover_processes([w.pid for w in started]) == []


def test_a_folder_without_chat_template_serves_completions(fleet, serving, tmp_path):
    worker = serving("base-model", model_folder(tmp_path / "base", chat_template=None))
    fleet.frontend.wait_for_model("base-model", timeout_s=60, workers=[worker])
    completion = httpx.post(f"{fleet.url}/v1/completions", timeout=30, json={
        "model": "base-model", "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0,
        "logprobs": 1})
    assert completion.status_code == 200, completion.text
    choice = completion.json()["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == completion.json()["usage"]["completion_tokens"]
    chat = httpx.post(f"{fleet.url}/v1/chat/completions", timeout=30, json={
        "model": "base-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    # Registered for completions only: the frontend has no chat route for it and answers 404
    # itself, before any worker sees the request (what a client gets; docs/dynamo.md).
    assert chat.status_code == 404, (chat.status_code, chat.text)


def test_a_model_the_frontend_rejects_ends_the_wait_with_its_reason(fleet, serving, tmp_path):
    broken = "{% for m in messages %}{{ m.content }"  # not valid Jinja
    worker = serving("broken-model", model_folder(tmp_path / "broken", chat_template=broken))
    started = time.monotonic()
    with pytest.raises(ModelRejected) as caught:
        fleet.frontend.wait_for_model("broken-model", timeout_s=WAIT_S, workers=[worker])
    waited = time.monotonic() - started
    message = str(caught.value)
    print(f"rejected after {waited:.1f} s: {message}")
    assert caught.value.model == "broken-model"
    assert caught.value.reason.startswith("prompt_formatter_from_mdc: syntax error")
    assert "\n" not in message and "\x1b" not in message
    assert "\x1b" not in fleet.frontend.log_tail()
