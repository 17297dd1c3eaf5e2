"""Standard-library helpers that every adapter may use (ports on this host, process groups).

Not an adapter: it wraps no third-party thing, and imports only the standard library and core,
so adapters importing it stay independent of each other (tests/layering.py states the rule).
"""

from rollout_fleet.adapters.shared.net import PORT_RANGE, PortsTaken, free_port, is_loopback
from rollout_fleet.adapters.shared.port_claims import release_ports, sweep_stale_claims
from rollout_fleet.adapters.shared.processes import read_tail, stop_process_group

__all__ = ["PORT_RANGE", "PortsTaken", "free_port", "is_loopback", "read_tail", "release_ports",
           "stop_process_group", "sweep_stale_claims"]
