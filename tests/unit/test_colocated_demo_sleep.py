"""The colocated demo's checks, the parts that run without a GPU: reading vLLM's KV-cache size
from its worker log, the sleep line, the failure when answers change over a sleep, the worker
tree's host memory and its line over the cycles, and the options that go with --colocated."""

import os
import subprocess
import sys

import pytest
from rollout_fleet.wiring.cli import main
from rollout_fleet.wiring.demo.colocated_checks import (
    check_sleep,
    cuda_graphs_line,
    host_memory_line,
    host_memory_mib,
    kv_cache_mib,
    sleep_line,
)
from rollout_fleet.wiring.demo.run import DemoFailed

FIGURES = {"sleep_freed_mib": 42626.0, "wake_took_mib": 42624.0, "kv_cache_mib": 42609.0,
           "answers_equal_after_wake": 8, "answers": 8, "max_dlogprob_after_wake": 1.4e-6}


def test_the_kv_cache_size_is_the_last_one_vllm_logged(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text("(EngineCore) INFO [gpu_worker.py:539] Available KV cache memory: 1.5 GiB\n"
                   "(EngineCore) INFO [gpu_worker.py:539] Available KV cache memory: 41.61 GiB\n")
    assert kv_cache_mib(log) == pytest.approx(41.61 * 1024)
    log.write_text("no such line\n")
    assert kv_cache_mib(log) is None
    assert kv_cache_mib(tmp_path / "absent.log") is None


def test_the_cuda_graphs_line_is_vllms_own_or_none(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text("(EngineCore pid=7) INFO [gpu_model_runner.py:4170] Graph capturing finished"
                   " in 12 secs, took 0.48 GiB\n(EngineCore pid=7) INFO ready\n")
    assert cuda_graphs_line(log) == "Graph capturing finished in 12 secs, took 0.48 GiB"
    log.write_text("(EngineCore pid=7) INFO enforce_eager=True\n")
    assert cuda_graphs_line(log) is None
    assert cuda_graphs_line(tmp_path / "absent.log") is None


def test_the_line_gives_the_freed_share_of_the_kv_cache():
    line = sleep_line(FIGURES)
    assert "level-1 sleep freed 42,626 MiB" in line and "100% of the 42,609 MiB KV cache" in line
    assert "8 of 8" in line and "refit" not in line
    assert "not found in its log" in sleep_line({**FIGURES, "kv_cache_mib": None})


def test_a_level_2_line_gives_the_share_of_the_engine_and_says_it_refit():
    line = sleep_line({**FIGURES, "level": 2, "sleep_freed_mib": 45000.0, "engine_mib": 50000.0})
    assert "level-2 sleep freed 45,000 MiB" in line
    assert "90% of the 50,000 MiB the engine took at its start" in line
    assert "after the wake and a refit of the same weights" in line


def test_answers_that_changed_over_a_sleep_fail_the_demo():
    check_sleep(FIGURES)
    with pytest.raises(DemoFailed, match="7 of 8 greedy answers"):
        check_sleep({**FIGURES, "answers_equal_after_wake": 7})


def test_host_memory_counts_the_processes_under_the_worker():
    """A child holding 256 MiB raises the tree's figure by about that much."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(256 << 20);"
                              " b[::4096] = b'x' * len(b[::4096]); print(1, flush=True);"
                              " time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"  # its memory is touched
        alone = host_memory_mib(child.pid)
        assert alone >= 256
        assert host_memory_mib(os.getpid()) >= alone  # the test process and its child
    finally:
        child.kill()
        child.wait()


def test_the_host_memory_line_gives_first_last_peak_and_growth():
    steps = [{"worker_host_mib": m} for m in (5000.0, 5400.0, 5100.0)]
    line = host_memory_line(steps)
    assert "after each of 3 cycles" in line
    assert "first 5,000 MiB, last 5,100 MiB, peak 5,400 MiB, growth +100 MiB" in line


def test_the_colocated_options_are_refused_without_colocated(capsys):
    assert main(["demo", "--in-memory", "--sleep-level", "2", "--dtype", "bfloat16"]) == 2
    assert "--dtype, --sleep-level go with --colocated" in capsys.readouterr().err
