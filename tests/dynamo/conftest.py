"""One real Dynamo frontend + one worker process (MemoryEngine) shared by the dynamo tier."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import httpx
import pytest

from tests.support import free_port, leftover_processes, start_child, stop_child

SERVED_MODEL = "mem"
CONTROL_SECRET = "test-control-secret"
ENGINE_SEED = 0
CONTEXT_LENGTH = 256


@attrs.frozen
class Fleet:
    run_dir: Path
    url: str
    system_url: str
    worker: object  # subprocess.Popen
    frontend: object  # DynamoFrontend
    model_path: Path

    def control(self, name: str, body: dict | None = None, *, secret: str | None = CONTROL_SECRET):
        payload = dict(body or {})
        if secret is not None:
            payload["control_secret"] = secret
        return httpx.post(f"{self.system_url}/engine/control/{name}", json=payload, timeout=10)


def worker_config(run_dir: Path, system_port: int, served: str, **engine: object) -> dict:
    return {
        "engine": {"kind": "memory", "seed": ENGINE_SEED, "context_length": CONTEXT_LENGTH,
                   "test_controls": True, **engine},
        "run_dir": str(run_dir),
        "namespace": "test",
        "served_model_name": served,
        "system_port": system_port,
        "control_secret": CONTROL_SECRET,
    }


def start_worker_process(run_dir: Path, config: dict, name: str):
    path = run_dir / f"{name}.json"
    path.write_text(json.dumps(config))
    return start_child([sys.executable, "-m", "rollout_fleet.wiring.worker", "--config", str(path)],
                       log_path=run_dir / f"{name}.log")


@pytest.fixture(scope="session")
def dynamo_run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dynamo-run")


@pytest.fixture(scope="session")
def fleet(dynamo_run_dir: Path):
    try:
        from rollout_fleet.adapters.dynamo import DynamoFrontend
    except ImportError as exc:  # no skips: a missing component fails loudly
        pytest.fail(f"the dynamo tier needs ai-dynamo 1.6.1 installed (scripts/venv.sh): {exc}")
    run_dir = dynamo_run_dir
    system_port = free_port()
    worker = start_worker_process(run_dir, worker_config(run_dir, system_port, SERVED_MODEL), "worker")
    frontend = DynamoFrontend(run_dir, http_port=free_port()).start()
    try:
        try:
            frontend.wait_for_model(SERVED_MODEL, timeout_s=90, workers=[worker])
        except Exception:
            log = (run_dir / "worker.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"fleet did not come up; worker log tail:\n{log}") from None
        yield Fleet(run_dir, frontend.url, f"http://127.0.0.1:{system_port}", worker, frontend,
                    run_dir / "model-memory")
    finally:
        groups = [worker.pid, frontend.process.pid if frontend.process else worker.pid]
        stop_child(worker)
        frontend.stop()
        left = leftover_processes(groups)
        assert left == [], f"processes left behind by the dynamo tier: {left}"
