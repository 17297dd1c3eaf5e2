"""The fleet config's ``[door]`` section: its defaults, no door at 0, and a port that cannot
be the door's refused at load, naming it."""

from __future__ import annotations

import os
import socket

import pytest

from rollout_fleet.wiring.config import ConfigError, parse_config
from rollout_fleet.wiring.fleet_services import DriverServices

MEMORY = {"engine": {"kind": "memory"}}


def test_the_default_door_has_a_process_a_core_up_to_four_and_takes_the_fleets_deadlines(tmp_path):
    config = parse_config({**MEMORY, "timeouts": {"connect_s": 3, "request_s": 40},
                           "retry": {"max_attempts": 2}})
    assert config.door.processes == min(4, os.cpu_count() or 1)
    assert (config.door.port, config.door.trajectories, config.door.idle_s) == (0, 4096, 3600.0)
    settings = DriverServices(config, tmp_path).door_settings()
    assert (settings.connect_s, settings.read_s, settings.retry.max_attempts) == (3, 40, 2)
    assert settings.processes == config.door.processes
    assert parse_config({**MEMORY, "door": {"processes": 0}}).door.processes == 0


def test_a_door_port_in_use_or_the_frontends_is_refused_naming_it():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"door.port={port} is already in use"):
            parse_config({**MEMORY, "door": {"port": port}})
    with pytest.raises(ConfigError, match=rf"door.port={port}: frontend_port is the same"):
        parse_config({**MEMORY, "frontend_port": port, "door": {"port": port}})
    with pytest.raises(ConfigError, match="door.processes"):
        parse_config({**MEMORY, "door": {"processes": -1}})
    assert parse_config({**MEMORY, "door": {"processes": 0, "port": port}}).door.port == port
