"""Where a vLLM engine's ipc:// socket files go: a folder of its own unless the user chose one
(``VLLM_RPC_BASE_PATH``); another engine's folder left in the environment is not a choice. The
KV-event publisher's socket follows the choice."""

import os

from rollout_fleet.adapters.vllm.host.process import ipc_environment


def test_an_engine_gets_a_new_folder_of_its_own(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    first, env = ipc_environment()
    second, _ = ipc_environment()
    assert env == {"VLLM_RPC_BASE_PATH": first}
    assert os.path.isdir(first) and os.path.dirname(first) == str(tmp_path)
    assert second != first and os.path.isdir(second)


def test_a_folder_the_user_chose_is_used_as_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path / "sockets"))
    assert ipc_environment() == (None, {})


def test_another_engines_folder_left_in_the_environment_is_not_a_choice(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale, _ = ipc_environment()
    os.rmdir(stale)  # that engine closed
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", stale)
    folder, env = ipc_environment()
    assert folder is not None and folder != stale and os.path.isdir(folder)
    assert env == {"VLLM_RPC_BASE_PATH": folder}


def test_the_kv_event_socket_lies_in_the_chosen_folder_else_the_temp_folder(monkeypatch,
                                                                              tmp_path):
    from rollout_fleet.adapters.vllm.host.config import VllmEngineConfig

    config = VllmEngineConfig(model="m", kv_events_port=4321)
    worker_folder = tmp_path / "rollout-fleet-worker-x"
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(worker_folder))  # a fleet worker's own
    assert config.kv_events_endpoint == f"ipc://{worker_folder}/rollout-fleet-kv-events-4321"
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    outside = config.kv_events_endpoint
    assert outside == f"ipc://{tmp_path}/rollout-fleet-kv-events-4321"
    own, env = ipc_environment()  # an engine starting on its own: the same name all along
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", env["VLLM_RPC_BASE_PATH"])
    assert config.kv_events_endpoint == outside
    os.rmdir(own)
