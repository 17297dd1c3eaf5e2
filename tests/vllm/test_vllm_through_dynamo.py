"""A rollout through the real Dynamo frontend to a vLLM worker equals the direct ``serve_rollout``.

The worker is a real ``rollout_fleet.wiring.worker`` process of engine kind ``vllm`` serving the
same tiny model as the session's engine, which gives the direct answers (same weights, same
engine settings: greedy and seeded sampling are reproducible across vLLM instances).
"""

from __future__ import annotations

import json
import sys

from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from rollout_fleet.core.rollout import FinishReason, RolloutRequest, SamplingSpec
from rollout_fleet.core.wire import completion_body, parse_completion_answer
from tests.support import free_port, leftover_processes, start_child, stop_child

from .conftest import MODEL_SEED

SERVED_MODEL = "tiny-vllm"
EOS_TOKEN_ID = 2
WORKER_START_TIMEOUT_S = 300  # vLLM on 2 shared cores: 20-40 s idle, minutes under load


@attrs.define
class VllmFleet:
    """A frontend and a vLLM worker process, booting in the background until ``url()``."""

    run_dir: Path
    worker: Any
    frontend: Any
    _ready: bool = False

    def url(self) -> str:
        if not self._ready:
            try:
                self.frontend.wait_for_model(SERVED_MODEL, timeout_s=WORKER_START_TIMEOUT_S,
                                             workers=[self.worker])
            except Exception as exc:
                log = (self.run_dir / "worker.log").read_text(errors="replace")[-4000:]
                raise AssertionError(f"the vLLM worker did not come up ({exc}); its log:\n{log}") from None
            self._ready = True
        return self.frontend.url


@pytest.fixture(scope="module")
def vllm_fleet(tmp_path_factory, tiny_models):
    """One frontend and one vLLM worker process; both stopped by process group at the end.

    Returned before the worker is up, so the session's own engine can start meanwhile.
    """
    try:
        from rollout_fleet.adapters.dynamo import DynamoFrontend
    except ImportError as exc:  # no skips: a missing component fails loudly
        pytest.fail(f"this test needs ai-dynamo 1.6.1 installed (scripts/venv.sh): {exc}")
    run_dir = tmp_path_factory.mktemp("vllm-dynamo-run")
    config = {"engine": {"kind": "vllm", "model": str(tiny_models[MODEL_SEED])},
              "run_dir": str(run_dir), "namespace": "vllm-test", "served_model_name": SERVED_MODEL,
              "system_port": free_port(below=32768)}
    (run_dir / "worker.json").write_text(json.dumps(config))
    worker = start_child([sys.executable, "-m", "rollout_fleet.wiring.worker",
                          "--config", str(run_dir / "worker.json")], log_path=run_dir / "worker.log")
    frontend = DynamoFrontend(run_dir, http_port=free_port()).start()
    groups = [worker.pid, frontend.process.pid]
    try:
        yield VllmFleet(run_dir, worker, frontend)
    finally:
        stop_child(worker, timeout_s=30)
        frontend.stop()
        left = leftover_processes(groups, wait_s=10)
        assert left == [], f"processes left behind: {left}"


def through_frontend(fleet: VllmFleet, request: RolloutRequest):
    answer = httpx.post(f"{fleet.url()}/v1/completions", json=completion_body(request, SERVED_MODEL),
                        timeout=120)
    assert answer.status_code == 200, answer.text
    return parse_completion_answer(answer.content)


def direct(vllm_engine, request: RolloutRequest):
    return vllm_engine.serve(request.prompt_token_ids, request.max_new_tokens, request.sampling,
                             request.stop_strings, request_id=request.request_id)


def assert_same(served, expected):
    assert served.token_ids == expected.token_ids
    assert served.logprobs == expected.logprobs  # exact: JSON carries floats losslessly
    assert served.finish_reason == expected.finish_reason


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_rollout_through_frontend_equals_direct(vllm_fleet, vllm_engine, greedy):
    prompts = vllm_engine.prompts
    for index, prompt in enumerate(prompts[:3]):
        request = RolloutRequest(request_id=f"fe-{greedy}-{index}", prompt_token_ids=prompt,
                                 max_new_tokens=24,
                                 sampling=SamplingSpec(greedy=greedy, temperature=0.8, seed=index))
        assert_same(through_frontend(vllm_fleet, request), direct(vllm_engine, request))


def test_stop_string_through_frontend_equals_direct(vllm_fleet, vllm_engine, decode):
    prompt = vllm_engine.prompts[1]
    free = direct(vllm_engine, RolloutRequest(request_id="fe-free", prompt_token_ids=prompt,
                                              max_new_tokens=24))
    stop = decode(free.token_ids[:6])[-2:]
    request = RolloutRequest(request_id="fe-stop", prompt_token_ids=prompt, max_new_tokens=24,
                             stop_strings=(stop,))
    expected = direct(vllm_engine, request)
    assert expected.finish_reason is FinishReason.STOP
    assert_same(through_frontend(vllm_fleet, request), expected)


def test_rollout_ending_in_eos_keeps_every_token_through_frontend(vllm_fleet, vllm_engine):
    """The frontend ends a stream at EOS; the rollout's one final chunk must still arrive whole."""
    prompt = vllm_engine.prompts[0]
    for seed in range(300):
        request = RolloutRequest(request_id=f"fe-eos-{seed}", prompt_token_ids=prompt,
                                 max_new_tokens=48, sampling=SamplingSpec(greedy=False, seed=seed))
        expected = direct(vllm_engine, request)
        if expected.token_ids[-1] == EOS_TOKEN_ID:
            break
    else:
        pytest.fail("no seed in 300 sampled an EOS within 48 tokens")
    assert expected.finish_reason is FinishReason.STOP
    assert_same(through_frontend(vllm_fleet, request), expected)
