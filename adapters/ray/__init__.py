"""Ray adapters: placement of workers into a placement group, one bundle each."""

from rollout_fleet.adapters.ray.placement import RayPlacement

__all__ = ["RayPlacement"]
