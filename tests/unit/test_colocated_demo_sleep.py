"""The colocated demo's sleep check, the parts that run without a GPU: reading vLLM's KV-cache
size from its worker log, the line it prints, and the failure when answers change over a sleep."""

import pytest
from rollout_fleet.wiring.demo.colocated import _check_sleep, _kv_cache_mib, _sleep_line
from rollout_fleet.wiring.demo.run import DemoFailed

FIGURES = {"sleep_freed_mib": 42626.0, "wake_took_mib": 42624.0, "kv_cache_mib": 42609.0,
           "answers_equal_after_wake": 8, "answers": 8, "max_dlogprob_after_wake": 1.4e-6}


def test_the_kv_cache_size_is_the_last_one_vllm_logged(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text("(EngineCore) INFO [gpu_worker.py:539] Available KV cache memory: 1.5 GiB\n"
                   "(EngineCore) INFO [gpu_worker.py:539] Available KV cache memory: 41.61 GiB\n")
    assert _kv_cache_mib(log) == pytest.approx(41.61 * 1024)
    log.write_text("no such line\n")
    assert _kv_cache_mib(log) is None
    assert _kv_cache_mib(tmp_path / "absent.log") is None


def test_the_line_gives_the_freed_share_of_the_kv_cache():
    line = _sleep_line(FIGURES)
    assert "freed 42,626 MiB" in line and "= 100% of the 42,609 MiB KV cache" in line
    assert "8 of 8" in line
    assert "not found in its log" in _sleep_line({**FIGURES, "kv_cache_mib": None})


def test_answers_that_changed_over_a_sleep_fail_the_demo():
    _check_sleep(FIGURES)
    with pytest.raises(DemoFailed, match="7 of 8 greedy answers"):
        _check_sleep({**FIGURES, "answers_equal_after_wake": 7})
