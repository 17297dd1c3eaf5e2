"""A worker whose engine dies mid-batch: wait until it holds rollouts, kill its engine, and
measure how long the frontend still routed to it (probe requests, no retries)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from rollout_fleet.core.retry import is_transient_status
from rollout_fleet.wiring.fleet import call_control


def wait_for_in_flight(fleet, name: str, timeout_s: float = 60.0) -> int:
    """How many rollouts worker ``name`` itself holds (its ``stats`` control), once it holds one."""
    url, deadline = fleet.control_urls[name], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        in_flight = call_control(url, "stats", fleet.secret)["in_flight"]
        if in_flight > 0:
            return in_flight
        time.sleep(0.005)
    raise AssertionError(f"{name} held no rollout within {timeout_s:.0f} s")


def wait_until_lost(fleet, name: str, timeout_s: float = 60.0) -> dict[str, str]:
    """The fleet's ``lost_workers()`` once it names ``name``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lost = fleet.lost_workers()
        if name in lost:
            return lost
        time.sleep(0.05)
    raise AssertionError(f"the fleet did not report {name} lost within {timeout_s:.0f} s "
                         f"(lost: {fleet.lost_workers()})")


class RoutingProbe:
    """Once started, sends one small plain completion after another straight to the frontend
    (no retries) until the ``with`` block ends, and keeps each answer's time and status: a
    refused answer after the kill is the frontend still routing to the dead worker."""

    def __init__(self, frontend_url: str, model: str, interval_s: float = 0.02) -> None:
        self._url = f"{frontend_url}/v1/completions"
        self._body = json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 1,
                                 "temperature": 0}).encode()
        self._interval_s = interval_s
        self._stop = threading.Event()
        # (monotonic time sent, HTTP status or 0 for no HTTP answer, what came back)
        self.answers: list[tuple[float, int, str]] = []
        self._thread = threading.Thread(target=self._run, name="routing-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def __enter__(self) -> "RoutingProbe":
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            request = urllib.request.Request(self._url, data=self._body,
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    answer.read()
                    status, detail = answer.status, ""
            except urllib.error.HTTPError as error:
                status, detail = error.code, error.read()[:200].decode(errors="replace")
            except OSError as error:  # no HTTP answer: reset, refused, timed out
                status, detail = 0, f"{type(error).__name__}: {error}"
            self.answers.append((sent, status, detail))
            self._stop.wait(self._interval_s)

    def refused_after(self, since: float) -> list[tuple[float, int, str]]:
        """(seconds after ``since``, status, what came back) of every probe sent since then
        that got no 200."""
        return [(round(t - since, 3), s, d) for t, s, d in self.answers if t >= since and s != 200]

    def served_after(self, since: float) -> int:
        return sum(1 for t, s, _ in self.answers if t >= since and s == 200)


def retryable(status: int) -> bool:
    """What the driver's retry rule sends again: no HTTP answer (0), 408, 429, 499, any 5xx."""
    return status == 0 or is_transient_status(status)


def kill_memory_engine(control_url: str, secret: str) -> None:
    """The memory engine's fault drill (its ``kill_engine`` control). The worker notices its dead
    engine within 0.1 s and starts to leave; when that wins the race with the control's own
    answer, Dynamo answers the control with its shutting-down refusal instead: the drill took
    effect either way. Any other answer is a failure."""
    try:
        call_control(control_url, "kill_engine", secret, timeout_s=10)
    except ValueError as refused:
        if "while the worker is shutting down" not in str(refused):
            raise
    except urllib.error.HTTPError as refused:
        if refused.code < 500:
            raise
