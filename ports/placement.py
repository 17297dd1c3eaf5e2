"""Placement port: reserve resources for workers, launch them, stop them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import attrs


@attrs.frozen
class WorkerHandle:
    index: int
    name: str
    control_url: str  # the worker's system port, e.g. http://127.0.0.1:9101
    pid: int | None = None
    node: str | None = None


class Placement(ABC):
    @abstractmethod
    def launch(self, worker_configs: Sequence[Mapping[str, Any]]) -> Sequence[WorkerHandle]:
        """Reserve one slot per worker and start each; return handles in the same order."""

    @abstractmethod
    def alive(self) -> Mapping[str, bool]:
        """Worker name -> whether its process still runs."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every worker and release the reservation; safe to repeat."""
