"""The NeMo-RL drop-in's door: NeMo-RL's token capture (``setup_token_capture``,
``set_rollout_weight_version``) and its checkpoint hooks (``pause_generation_for_checkpoint``,
``resume_generation_after_cut``, ``finish_generation_checkpoint``,
``resume_generation_after_checkpoint``), over the door's controls
(``wiring/door_control_client.py``; the fence: ``adapters/agent_door/fence.py``).

The door is the fleet's own where the fleet started one (``fleet.door``, then the drop-in's
``frontend_url`` and ``dp_openai_server_base_urls`` name it); else the drop-in starts one for
its fleet the first time it needs it (at construction where NeMo-Gym is to be served,
``vllm_cfg.expose_http_server``; else at ``setup_token_capture``) and stops it at shutdown. A pickled copy keeps the door's URL and control client, never its processes.

The checkpoint hooks map onto the door's fence and the fleet's own hold: pausing holds the
driver's new rollouts (``pause_generation``, in place) and freezes the door (new captured calls
wait, finished turns wait before staging, and the pause returns once none is being staged);
the split resume lets both go on with finished turns still held; finishing opens the door;
resuming after a checkpoint releases everything, as often as it is called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rollout_fleet.core.sampling_guard import SamplingProfiles
from rollout_fleet.wiring.door_control_client import DoorControlClient, DoorControlError

if TYPE_CHECKING:
    from rollout_fleet.adapters.nemo_rl import FleetGeneration
    from rollout_fleet.wiring.door import DoorProcesses
    from rollout_fleet.wiring.fleet import Fleet

# NeMo-RL's generation-config keys of its two sampling profiles.
_PROFILE_KEYS = ("temperature", "top_p", "val_temperature", "val_top_p")


def sampling_profiles(cfg: Mapping[str, Any]) -> SamplingProfiles:
    """The train and validation profiles of NeMo-RL's ``policy.generation`` (the validation
    one is the train one where ``val_*`` is unset)."""
    return SamplingProfiles.from_wire({key: cfg[key] for key in _PROFILE_KEYS
                                       if cfg.get(key) is not None})


class FleetDoor:
    """The door of ``fleet``: its own, or one started here (and stopped by ``stop``)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._started: DoorProcesses | None = None

    def processes(self) -> DoorProcesses:
        door: DoorProcesses | None = getattr(self._fleet, "door", None)
        if door is not None:
            return door
        if self._started is None:
            from rollout_fleet.wiring.door import start_door

            fleet, config = self._fleet, self._fleet.config
            self._started = start_door(fleet.frontend_url, fleet.model_path,
                                       config.served_model_name, config.chat,
                                       max_model_len=config.max_model_len,
                                       run_dir=fleet.run_dir, control_secret=fleet.secret)
        return self._started

    def running_url(self) -> str | None:
        """The URL of the fleet's own door, or of one started here; None before either."""
        door: DoorProcesses | None = getattr(self._fleet, "door", None) or self._started
        return door.url if door is not None else None

    def stop(self) -> None:
        started, self._started = self._started, None
        if started is not None:
            started.stop()


class DoorHooks:
    """NeMo-RL's token-capture and checkpoint calls of one drop-in. ``door``: how the owner
    reaches its door (None in a pickled copy, which uses the control client it was given);
    ``backend``: the class name NeMo-RL's refusals carry."""

    def __init__(self, native: FleetGeneration, profiles: SamplingProfiles,
                 door: Callable[[], DoorProcesses] | None, backend: str,
                 controls: DoorControlClient | None = None) -> None:
        self._native, self._profiles, self._door, self._backend = native, profiles, door, backend
        self._controls = controls

    @property
    def url(self) -> str:
        return self.controls().door_url

    def controls(self) -> DoorControlClient:
        if self._controls is None:
            if self._door is None:
                raise RuntimeError(f"this {self._backend} is a copy whose owner had no door")
            self._controls = self._door().controls()
        return self._controls

    def setup_token_capture(self, dp_cfg: Mapping[str, Any], staging_partition: str, *,
                            capture_media: bool = False,
                            generation_prefix_cuts_enabled: bool = False,
                            generation_cut_control_token: str | None = None,
                            generation_cut_control_timeout_s: float | None = None) -> None:
        """Every door process stages captured turns into ``staging_partition`` of NeMo-RL's
        TransferQueue (in the caller's Ray cluster) and guards every chat with this config's
        sampling profiles; with cuts enabled, NeMo-Gym's generation cuts are served under
        ``generation_cut_control_token``. No media columns (None, as NeMo-RL's backends
        without media answer)."""
        if capture_media:
            raise NotImplementedError(f"token_capture media capture is not supported for "
                                      f"{self._backend}: the door stages token columns only")
        self.controls().setup_token_capture(
            dp_cfg, staging_partition, sampling=self._profiles,
            generation_prefix_cuts_enabled=generation_prefix_cuts_enabled,
            generation_cut_control_token=generation_cut_control_token,
            generation_cut_control_timeout_s=generation_cut_control_timeout_s)

    def set_rollout_weight_version(self, version: int) -> None:
        """The version every captured call admitted from now on is stamped with."""
        self.controls().set_rollout_weight_version(version)

    def pause_generation_for_checkpoint(self, *, timeout_s: float | None = None) -> bool:
        self._native.pause_generation("in_place")
        self._fence("pause_generation_for_checkpoint", timeout_s)
        return True

    def resume_generation_after_cut(self, *, timeout_s: float | None = None) -> bool:
        return self._resume("resume_generation_after_cut", timeout_s)

    def finish_generation_checkpoint(self, *, timeout_s: float | None = None) -> bool:
        self._fence("finish_generation_checkpoint", timeout_s)
        return True

    def resume_generation_after_checkpoint(self, *, timeout_s: float | None = None) -> bool:
        return self._resume("resume_generation_after_checkpoint", timeout_s)

    def _resume(self, name: str, timeout_s: float | None) -> bool:
        """The door's fence moves first, then the fleet's own rollouts go on."""
        self._fence(name, timeout_s)
        self._native.continue_generation()
        return True

    def _fence(self, name: str, timeout_s: float | None) -> None:
        try:
            self.controls().fence(name, timeout_s)
        except DoorControlError as refused:
            if refused.status == 504:  # the door did not drain: NeMo-RL's timeout
                raise TimeoutError(f"{self._backend}.{name}: {refused}") from refused
            raise

    def copy_state(self) -> dict[str, Any]:
        """What a pickled copy keeps: its control client (URL and secret), once known."""
        return {"profiles": self._profiles, "controls": self._controls}
