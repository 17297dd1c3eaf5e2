"""Serving port: register an engine with the serving runtime and serve it until stopped."""

from __future__ import annotations

from abc import ABC, abstractmethod

from rollout_fleet.ports.engine import EnginePort


class Serving(ABC):
    @abstractmethod
    async def serve(self, engine: EnginePort) -> None:
        """Register ``engine`` and serve requests until cancelled."""
