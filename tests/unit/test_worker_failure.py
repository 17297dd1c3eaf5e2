"""What a fleet says of a worker that stopped while starting, read from its log: the worker's
own last word, and the error one of its engine's processes logged before it (vLLM's engine
core), which the worker's own message only points at; never the worker's own logged lines."""

from __future__ import annotations

from rollout_fleet.wiring.fleet_workers import worker_failure
from rollout_fleet.wiring.worker import FAILURE_MARK

ENGINE_CORE = ("(EngineCore pid=16938) ERROR 12-04 00:03:17 [core.py:1510] ValueError: To serve at"
               " least one request with the model's max seq len (512), more KV cache is needed")
OWN = "(MainProcess pid=16901) ERROR 12-04 00:03:18 [async_llm.py:99] RuntimeError: its own words"


def test_the_engine_cores_error_is_named_beside_the_workers_own(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text("\n".join([
        "(MainProcess pid=16901) INFO 12-04 00:03:10 [model.py:733] Resolved architecture",
        ENGINE_CORE, OWN,
        f"{FAILURE_MARK}RuntimeError: Engine core initialization failed. See root cause above."]))
    assert worker_failure(str(log)) == (
        "RuntimeError: Engine core initialization failed. See root cause above.; its EngineCore"
        " logged ValueError: To serve at least one request with the model's max seq len (512),"
        " more KV cache is needed")


def test_a_worker_that_said_nothing_is_reported_by_its_engine_cores_error_or_its_log(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text(f"{ENGINE_CORE}\n")
    said = worker_failure(str(log))
    assert said.startswith("no error reported; its EngineCore logged ValueError")
    log.write_text(f"{OWN}\nKilled\n")
    said = worker_failure(str(log))
    assert said.startswith("no error reported; its log ends:") and said.endswith("Killed\n")


def test_a_silent_worker_is_reported_by_how_it_ended(tmp_path):
    import signal

    log = tmp_path / "worker-0.log"
    log.write_text(f"{OWN}\n")
    said = worker_failure(str(log), -signal.SIGKILL)
    assert said.startswith("killed by SIGKILL (the kernel's out-of-memory killer sends it")
    assert "no error reported; its log ends:" in said
    assert worker_failure(str(log), -signal.SIGSEGV).startswith("killed by SIGSEGV, no error")
    assert worker_failure(str(log), 3).startswith("exited with status 3, no error reported;")
    log.write_text(f"{FAILURE_MARK}RuntimeError: its own words\n")
    assert worker_failure(str(log), 1) == "RuntimeError: its own words"  # its word comes first
