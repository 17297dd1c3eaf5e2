"""The door's trajectory store in one SQLite file (write-ahead log) in the fleet's run folder:
every door process opens it, so a trajectory recorded by one is continued by any other, and a
door process that dies loses nothing (a turn is committed before its answer is sent).

Bounded as the in-memory store is (``core.agent_turns.TrajectoryStore``): an entry untouched
for ``idle_s`` is gone (a read treats it as gone at once; the next write deletes it), and past
``capacity`` the least recently used go first. A turn's token IDs and logprobs are kept as
packed arrays (int32, float64): written and read back exactly, at the cost of a copy; a worker
(a Dynamo instance id, an unsigned 64-bit number) as its decimal text.
"""

from __future__ import annotations

import array
import json
import sqlite3
import threading
import time
from pathlib import Path

from rollout_fleet.core.agent_turns import (
    RecordedTurn, TrajectoryStore, TurnTokens, check_store_bounds,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    name TEXT PRIMARY KEY, touched REAL NOT NULL, message_count INTEGER NOT NULL,
    roles TEXT NOT NULL, worker TEXT, weight_version INTEGER, weight_versions TEXT NOT NULL,
    prompt BLOB NOT NULL, generated BLOB NOT NULL, logprobs BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS turns_by_touch ON turns (touched);
CREATE TABLE IF NOT EXISTS sessions (
    name TEXT PRIMARY KEY, touched REAL NOT NULL, worker TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_by_touch ON sessions (touched);
"""
_TABLES = ("turns", "sessions")
# One writer at a time across the door's processes; a write waits this long for the others.
BUSY_TIMEOUT_MS = 10_000


class SqliteTrajectories(TrajectoryStore):
    """The store at ``path`` (created if missing). Safe to share between threads of one
    process (one connection, behind a lock) and between processes (SQLite's own locks)."""

    def __init__(self, path: str | Path, capacity: int = 4096, idle_s: float = 600.0) -> None:
        check_store_bounds(capacity, idle_s)
        self.path, self.capacity, self.idle_s = Path(path), capacity, idle_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                   timeout=BUSY_TIMEOUT_MS / 1000)
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _use_write_ahead_log(self._db)
        # A commit reaches the OS before it returns (a process that dies keeps it); only a
        # machine that loses power may lose the last turns, and the machine's fleet with them.
        self._db.execute("PRAGMA synchronous = NORMAL")
        with self._lock:
            self._db.executescript(_SCHEMA)

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM turns").fetchone()[0])

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM turns WHERE name = ?", (name,)).fetchone() \
                is not None

    def latest(self, name: str, now: float) -> RecordedTurn | None:
        with self._lock:
            row = self._db.execute(
                "SELECT message_count, roles, worker, weight_version, weight_versions, prompt, "
                "generated, logprobs FROM turns WHERE name = ? AND touched > ?",
                (name, now - self.idle_s)).fetchone()
        return None if row is None else _turn_of(row)

    def record(self, name: str, turn: RecordedTurn, now: float) -> None:
        tokens = turn.tokens
        worker = None if turn.worker is None else str(turn.worker)
        row = (name, now, turn.message_count, json.dumps(turn.roles), worker,
               tokens.weight_version, json.dumps(tokens.weight_versions),
               _packed("i", tokens.prompt_token_ids), _packed("i", tokens.generation_token_ids),
               _packed("d", tokens.generation_log_probs))
        self._write("turns", name, now, (
            "INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO "
            "UPDATE SET touched = excluded.touched, message_count = excluded.message_count, "
            "roles = excluded.roles, worker = excluded.worker, "
            "weight_version = excluded.weight_version, weight_versions = "
            "excluded.weight_versions, prompt = excluded.prompt, generated = excluded.generated, "
            "logprobs = excluded.logprobs", row))

    def end(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM turns WHERE name = ?", (name,)).rowcount > 0

    def pinned_worker(self, session: str, now: float) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT worker FROM sessions WHERE name = ? AND touched > ?",
                                   (session, now - self.idle_s)).fetchone()
        return None if row is None else int(row[0])

    def pin(self, session: str, worker: int, now: float) -> None:
        self._write("sessions", session, now, (
            "INSERT INTO sessions VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE SET "
            "touched = excluded.touched, worker = excluded.worker", (session, now, str(worker))))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, table: str, name: str, now: float,
               upsert: tuple[str, tuple[object, ...]]) -> None:
        """One transaction: the idle entries of ``table`` deleted, the row written, the least
        recently used deleted past the capacity."""
        assert table in _TABLES
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(f"DELETE FROM {table} WHERE touched <= ?",
                                 (now - self.idle_s,))
                self._db.execute(*upsert)
                over = self._db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] \
                    - self.capacity
                if over > 0:
                    self._db.execute(f"DELETE FROM {table} WHERE name IN (SELECT name FROM "
                                     f"{table} WHERE name != ? ORDER BY touched LIMIT ?)",
                                     (name, over))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise


def _use_write_ahead_log(db: sqlite3.Connection) -> None:
    """Switch a new file to the write-ahead log (kept in the file: later opens only read it).
    The switch takes an exclusive lock without SQLite's busy wait, so door processes opening
    a new store at once retry it here."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        try:
            db.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _packed(kind: str, values: tuple[int, ...] | tuple[float, ...]) -> bytes:
    return array.array(kind, values).tobytes()  # kind "i": int32, "d": float64


def _ints(blob: bytes) -> tuple[int, ...]:
    values = array.array("i")
    values.frombytes(blob)
    return tuple(values)


def _floats(blob: bytes) -> tuple[float, ...]:
    values = array.array("d")
    values.frombytes(blob)
    return tuple(values)


def _turn_of(row: tuple[object, ...]) -> RecordedTurn:
    count, roles, worker, version, versions, prompt, generated, logprobs = row
    assert isinstance(roles, str) and isinstance(versions, str)
    assert isinstance(prompt, bytes) and isinstance(generated, bytes)
    assert isinstance(logprobs, bytes) and isinstance(count, int)
    tokens = TurnTokens(_ints(prompt), _ints(generated), _floats(logprobs), version if isinstance(version, int) else None,
                        json.loads(versions))
    return RecordedTurn(count, tuple(json.loads(roles)), tokens,
                        int(worker) if isinstance(worker, str) else None)
