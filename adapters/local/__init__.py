"""Local placement: workers as child processes of this one, on this machine (tests, a laptop,
load drills with many small workers)."""

from rollout_fleet.adapters.local.placement import LocalPlacement

__all__ = ["LocalPlacement"]
