"""The config of a fleet across nodes: refused by name when it cannot work, and what each
server binds (no server starts)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollout_fleet.adapters.dynamo.env import dynamo_env, user_kernel_caches
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.wiring.config import ConfigError, parse_config

MEMORY = {"kind": "memory"}


def config(**fields):
    return parse_config({"engine": MEMORY, **fields})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.org", "", "10.0.0.300"])
def test_a_bind_host_that_is_not_one_address_is_refused_by_name(host):
    with pytest.raises(ConfigError) as info:
        config(bind_host=host)
    assert "bind_host" in str(info.value) and repr(host)[1:-1] in str(info.value)


def test_one_machine_stays_on_loopback_with_file_discovery():
    one = config()
    assert not one.spans_nodes and one.discovery == "file" and one.bind_host == "127.0.0.1"
    # an address on a network, but no cluster to join: still one machine
    assert not config(bind_host="10.1.2.3").spans_nodes


def test_a_fleet_across_nodes_needs_etcd_discovery():
    with pytest.raises(ConfigError) as info:
        config(ray_address="10.1.2.3:6379", bind_host="10.1.2.3")
    assert "discovery='file'" in str(info.value) and "etcd" in str(info.value)
    spanning = config(ray_address="10.1.2.3:6379", bind_host="10.1.2.3", discovery="etcd")
    assert spanning.spans_nodes
    # joined from loopback, the fleet stays on this node
    assert not config(ray_address="127.0.0.1:6379").spans_nodes


def test_custom_resources_go_into_each_workers_bundle():
    c = config(resources_per_worker={"rollout_worker": 1}, placement_strategy="STRICT_SPREAD")
    assert c.bundle == {"CPU": 1.0, "rollout_worker": 1.0}
    assert c.placement_strategy == "STRICT_SPREAD"
    for bad, field in (({"CPU": 2}, "resources_per_worker.CPU"),
                       ({"rollout_worker": 0}, "resources_per_worker.rollout_worker")):
        with pytest.raises(ConfigError) as info:
            config(resources_per_worker=bad)
        assert field in str(info.value)


def test_every_dynamo_host_of_a_process_is_its_own_node_address(tmp_path):
    env = dynamo_env(tmp_path, host="10.77.0.2")
    hosts = {k: v for k, v in env.items() if k.endswith("_HOST")}
    assert set(hosts) == {"DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST",
                          "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST", "DYN_HTTP_HOST"}
    assert set(hosts.values()) == {"10.77.0.2"}
    assert set(v for k, v in dynamo_env(tmp_path).items() if k.endswith("_HOST")) == {"127.0.0.1"}
    with pytest.raises(InvalidValue):
        dynamo_env(tmp_path, host="0.0.0.0")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_replace_lost_workers_takes_true_or_false_only(value):
    assert config().replace_lost_workers is False
    assert config(replace_lost_workers=True).replace_lost_workers is True
    with pytest.raises(ConfigError) as info:
        config(replace_lost_workers=value)
    assert "replace_lost_workers" in str(info.value)


def test_vllms_cache_stays_the_users_while_home_moves_into_the_run(tmp_path, monkeypatch):
    """A worker's HOME is the run's own folder, but vLLM's cache is where vLLM would keep it,
    so its model inspection runs once per machine rather than once per worker start."""
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    env = dynamo_env(tmp_path / "run")
    assert env["HOME"] == str(tmp_path / "run" / "home")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "user-cache" / "vllm")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "chosen"))
    assert dynamo_env(tmp_path / "run")["VLLM_CACHE_ROOT"] == str(tmp_path / "chosen")


def test_the_kernel_caches_stay_the_users_while_home_moves_into_the_run(tmp_path, monkeypatch):
    """CUDA's, FlashInfer's, Triton's, DeepGEMM's and torch's extension caches default to
    HOME: a worker whose HOME is the run's would compile every kernel again at each start."""
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    for name in ("CUDA_CACHE_PATH", "FLASHINFER_WORKSPACE_BASE", "DG_JIT_CACHE_DIR",
                 "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME", "TRITON_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "chosen-triton"))
    env = dynamo_env(tmp_path / "run")
    assert env["HOME"] == str(tmp_path / "run" / "home")
    assert env["CUDA_CACHE_PATH"] == str(tmp_path / "user" / ".nv" / "ComputeCache")
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "user")
    assert env["DG_JIT_CACHE_DIR"] == str(tmp_path / "user" / ".deep_gemm")
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "user" / ".cache" / "torch_extensions")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "chosen-triton")  # as the user set it


def test_a_kernel_cache_follows_the_root_its_tool_would_put_it_under(tmp_path, monkeypatch):
    """Triton roots its cache at TRITON_HOME and torch its extensions at XDG_CACHE_HOME when
    set: a user who set only the root keeps the caches there, not under ~ again."""
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "triton-root"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env = dynamo_env(tmp_path / "run")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "triton-root" / ".triton" / "cache")
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "xdg" / "torch_extensions")


@pytest.mark.parametrize("roots_set", [False, True])
def test_the_kernel_caches_named_are_where_triton_and_torch_put_them_for_the_user(
        tmp_path, monkeypatch, roots_set):
    """The same places Triton and torch themselves compute in the launching user's
    environment, asked of the installed libraries."""
    for name in ("TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "TRITON_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    if roots_set:
        monkeypatch.setenv("TRITON_HOME", str(tmp_path / "triton-root"))
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    asked = subprocess.run(
        [sys.executable, "-c", "import torch.utils.cpp_extension as e, triton.knobs as k;"
         " print(e.get_default_build_root()); print(k.cache.dir)"],
        capture_output=True, text=True, check=True, timeout=120)
    torch_root, triton_cache = asked.stdout.splitlines()[-2:]  # after any notice printed
    caches = user_kernel_caches()
    assert (caches["TORCH_EXTENSIONS_DIR"], caches["TRITON_CACHE_DIR"]) == (torch_root, triton_cache)
