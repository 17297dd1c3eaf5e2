"""Worker control port: the driver's channel to one worker (refit, cache flush, versions);
declared in core (``rollout_fleet.core.control``), where the driver's services call it."""

from rollout_fleet.core.control import WorkerControl

__all__ = ["WorkerControl"]
