"""Clock port: defined in the core (its services sleep through it), re-exported here."""

from rollout_fleet.core.clock import Clock, SystemClock

__all__ = ["Clock", "SystemClock"]
