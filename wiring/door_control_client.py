"""A blocking client of the door's controls (``adapters/agent_door/controls.py``): what the
NeMo-RL drop-in calls for NeMo-RL's ``setup_token_capture`` and ``set_rollout_weight_version``
and for a checkpoint's generation fence (``adapters/agent_door/fence.py``). One call reaches
one door process; what it sets holds for all of them.

    door = start_door(..., control_secret=fleet.secret)
    controls = door.controls()              # or DoorControlClient(door.url, fleet.secret)
    controls.setup_token_capture(dp_cfg, "staging", sampling={"temperature": 1.0, "top_p": 1.0})
    controls.set_rollout_weight_version(0)
    controls.fence("pause_generation_for_checkpoint", timeout_s=30)  # ... then a release
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from rollout_fleet.core.errors import RolloutFleetError
from rollout_fleet.core.sampling_guard import SamplingProfiles

CONTROL_PATH = "/door/control/"
FENCE_CONTROLS = ("pause_generation_for_checkpoint", "resume_generation_after_cut",
                  "finish_generation_checkpoint", "resume_generation_after_checkpoint")
# What a fence control may take beyond its own timeout: the HTTP round trip.
_FENCE_MARGIN_S = 10.0


class DoorControlError(RolloutFleetError):
    """A door control refused or failed: its HTTP status, its message and the field at fault
    (400), the staging it could not reach (503), the secret (401)."""

    def __init__(self, control: str, status: int, message: str, param: str | None) -> None:
        self.control, self.status, self.param = control, status, param
        super().__init__(f"door control {control} answered HTTP {status}: {message}")


def callers_ray_address() -> str | None:
    """The address of the Ray cluster this process is connected to, if it is."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    address = ray.get_runtime_context().gcs_address
    return str(address) if address else None


class DoorControlClient:
    def __init__(self, door_url: str, secret: str, timeout_s: float = 120.0) -> None:
        self.door_url = door_url.rstrip("/")
        self._secret = secret
        self.timeout_s = timeout_s

    def setup_token_capture(self, dp_cfg: Mapping[str, Any], staging_partition: str, *,
                            capture_media: bool = False,
                            generation_prefix_cuts_enabled: bool = False,
                            generation_cut_control_token: str | None = None,
                            generation_cut_control_timeout_s: float | None = None,
                            sampling: SamplingProfiles | Mapping[str, float] | None = None,
                            ray_address: str | None = None) -> dict[str, Any]:
        """NeMo-RL's ``setup_token_capture`` for every door process: stage turns into
        ``staging_partition`` of the TransferQueue in the Ray cluster at ``ray_address``
        (default: the caller's own cluster); serve generation cuts with
        ``generation_cut_control_token`` as their bearer token; check every chat request
        against ``sampling`` (NeMo-RL's ``temperature``, ``top_p``, ``val_temperature``,
        ``val_top_p``). Returns the setup as the door describes it."""
        if isinstance(sampling, SamplingProfiles):
            sampling = sampling.to_wire()
        body = {"dp_cfg": dict(dp_cfg), "staging_partition": staging_partition,
                "capture_media": capture_media,
                "generation_prefix_cuts_enabled": generation_prefix_cuts_enabled,
                "generation_cut_control_token": generation_cut_control_token,
                "generation_cut_control_timeout_s": generation_cut_control_timeout_s,
                "sampling": dict(sampling) if sampling is not None else None,
                "ray_address": ray_address or callers_ray_address()}
        return self.call("setup_token_capture", body)

    def set_rollout_weight_version(self, version: int) -> None:
        """The rollout weight version every call admitted from now on is stamped with."""
        self.call("set_rollout_weight_version", {"version": version})

    def token_capture_status(self) -> dict[str, Any]:
        return self.call("token_capture_status", {})

    def fence(self, name: str, timeout_s: float | None = None) -> dict[str, Any]:
        """One of the fence's controls (``FENCE_CONTROLS``); a pause waits up to
        ``timeout_s`` (the door's default: 60 s) for the door to drain, else HTTP 504."""
        if name not in FENCE_CONTROLS:
            raise ValueError(f"{name!r} is not a fence control: {', '.join(FENCE_CONTROLS)}")
        waited = self.timeout_s if timeout_s is None else timeout_s + _FENCE_MARGIN_S
        return self.call(name, {"timeout_s": timeout_s}, timeout_s=waited)

    def call(self, name: str, body: Mapping[str, Any],
             timeout_s: float | None = None) -> dict[str, Any]:
        payload = json.dumps({**body, "control_secret": self._secret}).encode()
        request = urllib.request.Request(f"{self.door_url}{CONTROL_PATH}{name}", data=payload,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as answer:
                status, raw = answer.status, answer.read()
        except urllib.error.HTTPError as refused:
            status, raw = refused.code, refused.read()
        try:
            data = json.loads(raw)
        except ValueError:
            data = {"error": raw[:300].decode("utf-8", "replace")}
        if status != 200 or not isinstance(data, dict) or data.get("status") != "ok":
            error = data if isinstance(data, dict) else {}
            raise DoorControlError(name, status, str(error.get("error", data)),
                                   error.get("param"))
        return data
