"""Optional port: an engine that takes colocated refits (``core.colocated_refit``).

The trainer shares buffers on the engine's own device; the engine reads each bucket straight
out of them. An engine implementing this is also a ``RefitTarget`` (parameters, weight
version, cache reset), and commits a colocated refit the way it commits any other. Declared
in core (``rollout_fleet.core.engine_ports``), where the worker's service drives it.
"""

from __future__ import annotations

from rollout_fleet.core.engine_ports import ColocatedByPart, ColocatedTarget

__all__ = ["ColocatedByPart", "ColocatedTarget"]
