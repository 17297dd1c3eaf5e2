"""The device a fleet or an engine runs on: one vocabulary for the fleet, its engines and its
collective (``cpu`` or ``gpu``; torch's ``cuda`` is read as ``gpu``)."""

from __future__ import annotations

from typing import Any

from rollout_fleet.core.validate import Vocabulary


class Device(Vocabulary):
    CPU = "cpu"
    GPU = "gpu"

    @classmethod
    def _missing_(cls, value: Any) -> "Device | None":
        # Torch's and vLLM's name for the GPU, accepted wherever a device is read.
        return cls.GPU if value == "cuda" else None

    @property
    def torch_type(self) -> str:
        """Torch's name for it: ``cpu`` or ``cuda``."""
        return "cuda" if self is Device.GPU else "cpu"
