"""Where a vLLM engine's ipc:// socket files go: a folder of its own unless the user chose one
(``VLLM_RPC_BASE_PATH``); another engine's folder left in the environment is not a choice."""

import os

from rollout_fleet.adapters.vllm.process import ipc_environment


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
