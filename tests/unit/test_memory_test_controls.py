"""The memory engine's test controls (engine_stats and the fault drills) are served only when a
worker's config opts in (``engine.test_controls = true``); by default each is refused, naming
the setting."""

from __future__ import annotations

import asyncio

import pytest

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.wiring.config import ConfigError, parse_config
from rollout_fleet.wiring.worker import build_engine


def built(tmp_path, **options):
    return build_engine({"engine": {"kind": "memory", **options}, "run_dir": str(tmp_path)})


@pytest.mark.parametrize("drill", ["engine_stats", "kill_engine", "freeze_engine"])
def test_a_test_control_is_refused_by_name_unless_the_worker_opts_in(tmp_path, drill):
    engine = built(tmp_path)
    with pytest.raises(InvalidValue, match=f"engine.test_controls.*{drill} is a test control"):
        asyncio.run(engine.controls[drill]({}))
    assert engine.engine.dead_reason() is None


def test_with_test_controls_on_kill_engine_kills_the_engine(tmp_path):
    engine = built(tmp_path, test_controls=True)
    assert asyncio.run(engine.controls["engine_stats"]({}))["served_count"] == 0
    asyncio.run(engine.controls["kill_engine"]({"reason": "drill"}))
    assert engine.engine.dead_reason() is not None


def test_test_controls_must_be_a_bool():
    with pytest.raises(ConfigError, match="engine.test_controls: must be true or false"):
        parse_config({"engine": {"kind": "memory", "test_controls": "yes"}})
