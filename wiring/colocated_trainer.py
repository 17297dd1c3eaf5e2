"""A trainer's way to the worker it is colocated with: that worker's control (the fleet's
HTTP control, with the fleet's secret) and a ``ColocatedSender`` over it.

The trainer names its worker by index (its place in the fleet's worker list) or by id (the
worker's name); which trainer rank sits beside which worker is the trainer's call (or the
fleet config's `[colocation]` section, wiring/colocation.py).
"""

from __future__ import annotations

from typing import Any

from rollout_fleet.core.errors import InvalidValue


def worker_endpoint(fleet: Any, worker: int | str) -> tuple[str, str]:
    """(worker id, control URL) of ``worker``: an index into ``fleet.workers`` or a worker id."""
    urls = fleet.control_urls
    names = list(urls)
    if isinstance(worker, int) and not isinstance(worker, bool):
        if not 0 <= worker < len(names):
            raise InvalidValue("worker", worker, f"the fleet has workers 0..{len(names) - 1}")
        name = names[worker]
    elif isinstance(worker, str) and worker in urls:
        name = worker
    else:
        raise InvalidValue("worker", worker, f"an index or one of the fleet's workers {names}")
    return name, urls[name]


def worker_control(fleet: Any, worker: int | str) -> Any:
    """The ``WorkerControl`` of one worker of ``fleet``."""
    name, url = worker_endpoint(fleet, worker)
    return control_at(name, url, fleet.secret)


def control_at(worker_id: str, control_url: str, secret: str) -> Any:
    """A worker's control from its id, URL and the fleet's secret (a trainer in a process of
    its own, given them by the driver)."""
    from rollout_fleet.adapters.http import HttpWorkerControl

    return HttpWorkerControl(worker_id, control_url, secret=secret)


def colocated_sender(control: Any, *, device: str = "cpu", buffer_bytes: int = 1 << 30,
                     num_buffers: int = 2, timeout_s: float = 600.0, mode: str | None = None) -> Any:
    """A trainer's ``ColocatedSender`` to the worker behind ``control`` (buffers on ``device``,
    which must be the worker's engine's: the CPU, or the GPU both share)."""
    from rollout_fleet.adapters.collective.colocated_sender import ColocatedSender

    return ColocatedSender(control, buffer_bytes=buffer_bytes, num_buffers=num_buffers,
                           device=device, timeout_s=timeout_s, mode=mode)
