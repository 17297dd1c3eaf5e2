"""What every process of the door must agree on, kept in the door's SQLite file beside the
trajectories: the token-capture setup (``CaptureSettings``, set by the trainer's
``setup_token_capture``), the rollout weight version turns are stamped with (its
``set_rollout_weight_version``), the phase of a checkpoint's generation fence (its
``pause_generation_for_checkpoint`` and the calls that release it, ``fence.py``) and the
receipts of generation cuts. A control reaches one
door process; each process reads the setup and the version once per call (one indexed read),
so every process stamps the same version and a call keeps the one in force when it began.

A cut's receipt is claimed before the cut runs (one process cuts an inventory; the same
inventory sent again, to any process, gets the same receipt).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import attrs

from rollout_fleet.adapters.agent_door.store import BUSY_TIMEOUT_MS
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.sampling_guard import SamplingProfiles

_SCHEMA = """
CREATE TABLE IF NOT EXISTS door_settings (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS generation_cuts (
    checkpoint_id TEXT NOT NULL, inventory_digest TEXT NOT NULL, claimed REAL NOT NULL,
    receipt TEXT, PRIMARY KEY (checkpoint_id, inventory_digest));
"""
_CAPTURE, _VERSION = "token_capture", "rollout_weight_version"
_FENCE = "generation_checkpoint_phase"
CutClaim = Literal["ours", "pending", "done"]
# A checkpoint's generation fence: ``open`` (no checkpoint), ``frozen`` (new calls held and
# finished turns kept from staging), ``cut`` (calls decode again, finished turns still kept).
FencePhase = Literal["open", "frozen", "cut"]
FENCE_PHASES: tuple[FencePhase, ...] = ("open", "frozen", "cut")


@attrs.frozen
class CaptureSettings:
    """One ``setup_token_capture``: where turns are staged (NeMo-RL's data-plane config and
    staging partition, the Ray cluster TransferQueue runs in), whether generation cuts are
    served (and the digest of their bearer token: the token itself is never stored), and the
    trainer's sampling profiles, which every chat request must match. ``setup`` counts the
    setups, so a process sees a new one."""

    dp_cfg: dict[str, Any]
    staging_partition: str
    ray_address: str | None = None
    cuts_enabled: bool = False
    cut_token_sha256: str | None = attrs.field(default=None, repr=False)
    cut_timeout_s: float = 30.0
    sampling: SamplingProfiles | None = None
    setup: int = 0

    def cut_token_matches(self, token: str) -> bool:
        if self.cut_token_sha256 is None:
            return False
        return hmac.compare_digest(token_digest(token), self.cut_token_sha256)

    def to_json(self) -> str:
        fields = attrs.asdict(self, recurse=False)
        fields["sampling"] = self.sampling.to_wire() if self.sampling else None
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> CaptureSettings:
        fields = json.loads(text)
        sampling = fields.pop("sampling")
        return cls(**fields, sampling=SamplingProfiles.from_wire(sampling) if sampling else None)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@attrs.frozen
class DoorSnapshot:
    """The setup and the weight version in force as a call begins."""

    capture: CaptureSettings | None
    weight_version: int


class DoorState:
    """The shared state in the SQLite file at ``path`` (the trajectories' file): blocking
    calls, safe from several threads and processes."""

    def __init__(self, path: str | Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(Path(path), isolation_level=None, check_same_thread=False,
                                   timeout=BUSY_TIMEOUT_MS / 1000)
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self._db.execute("PRAGMA journal_mode = WAL")
        with self._lock:
            self._db.executescript(_SCHEMA)

    def snapshot(self) -> DoorSnapshot:
        with self._lock:
            rows = dict(self._db.execute("SELECT name, value FROM door_settings WHERE name IN "
                                         "(?, ?)", (_CAPTURE, _VERSION)).fetchall())
        capture = rows.get(_CAPTURE)
        return DoorSnapshot(CaptureSettings.from_json(capture) if capture else None,
                            int(rows.get(_VERSION, 0)))

    def set_capture(self, settings: CaptureSettings | None) -> CaptureSettings | None:
        """Install ``settings`` (numbered after the last setup), or remove the setup; the
        settings installed."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT value FROM door_settings WHERE name = ?",
                                       (_CAPTURE,)).fetchone()
                if settings is None:
                    self._db.execute("DELETE FROM door_settings WHERE name = ?", (_CAPTURE,))
                else:
                    last = CaptureSettings.from_json(row[0]).setup if row else 0
                    settings = attrs.evolve(settings, setup=last + 1)
                    self._put(_CAPTURE, settings.to_json())
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return settings

    def set_weight_version(self, version: int) -> None:
        if type(version) is not int or version < 0:
            raise InvalidValue("version", version, "a rollout weight version is an integer >= 0")
        with self._lock:
            self._put(_VERSION, str(version))

    def fence_phase(self) -> FencePhase:
        with self._lock:
            row = self._db.execute("SELECT value FROM door_settings WHERE name = ?",
                                   (_FENCE,)).fetchone()
        phase = row[0] if row else "open"
        return phase if phase in FENCE_PHASES else "open"

    def move_fence(self, to: FencePhase, allowed_from: tuple[FencePhase, ...]
                   ) -> tuple[FencePhase, FencePhase]:
        """Set the phase to ``to`` where it is one of ``allowed_from`` (else leave it);
        ``(phase before, phase after)``, read and written in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT value FROM door_settings WHERE name = ?",
                                       (_FENCE,)).fetchone()
                before: FencePhase = row[0] if row and row[0] in FENCE_PHASES else "open"
                after = to if before in allowed_from else before
                if after != before:
                    self._put(_FENCE, after)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return before, after

    def _put(self, name: str, value: str) -> None:
        self._db.execute("INSERT INTO door_settings VALUES (?, ?) ON CONFLICT (name) DO UPDATE "
                         "SET value = excluded.value", (name, value))

    def claim_cut(self, checkpoint_id: str, digest: str, now: float,
                  stale_s: float) -> tuple[CutClaim, dict[str, Any] | None]:
        """``("ours", None)``: this caller cuts the inventory (no one has, or its claimer
        died ``stale_s`` ago); ``("done", receipt)``; or ``("pending", None)``: wait."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT claimed, receipt FROM generation_cuts WHERE checkpoint_id = ? AND "
                    "inventory_digest = ?", (checkpoint_id, digest)).fetchone()
                claim: CutClaim = "ours" if row is None or (
                    row[1] is None and now - row[0] > stale_s) else \
                    "done" if row[1] is not None else "pending"
                if claim == "ours":
                    self._db.execute("INSERT OR REPLACE INTO generation_cuts VALUES "
                                     "(?, ?, ?, NULL)", (checkpoint_id, digest, now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return claim, json.loads(row[1]) if claim == "done" else None

    def finish_cut(self, checkpoint_id: str, digest: str, receipt: dict[str, Any] | None) -> None:
        """Keep ``receipt`` for the inventory, or (None) give up its claim."""
        with self._lock:
            if receipt is None:
                self._db.execute("DELETE FROM generation_cuts WHERE checkpoint_id = ? AND "
                                 "inventory_digest = ?", (checkpoint_id, digest))
            else:
                self._db.execute("UPDATE generation_cuts SET receipt = ? WHERE checkpoint_id "
                                 "= ? AND inventory_digest = ?",
                                 (json.dumps(receipt), checkpoint_id, digest))

    def close(self) -> None:
        with self._lock:
            self._db.close()


class SharedState:
    """The door's async face of its ``DoorState``: each call in one thread of its own."""

    def __init__(self, state: DoorState) -> None:
        self.state = state
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="door-state")

    async def run(self, call: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, call, *args)

    async def snapshot(self) -> DoorSnapshot:
        snapshot: DoorSnapshot = await self.run(self.state.snapshot)
        return snapshot

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.state.close()
