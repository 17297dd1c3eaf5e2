"""A torch.distributed group for refits, formed without touching the global default group.

Rank 0 (the trainer's first rank) hosts a TCPStore on a loopback-or-given address; every rank
declares its view of the world there, and every rank checks the others' declarations before
any tensor moves, so a wrong world size is a clear error on every side rather than a hang.

The data group (the one broadcasts run in) holds trainer rank 0 and every worker rank only:
trainer ranks 1..T-1 join the rendezvous, so the world size is checked, and then do nothing.
A sharded refit (``every_rank=True``) puts every rank in it: each trainer rank sends its shards.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from rollout_fleet.adapters.shared.errors import first_line
from rollout_fleet.core.errors import InvalidValue, RefitError, WorldSizeMismatch

BACKENDS = ("gloo", "nccl")
_POLL_S = 0.02
_DEVICE_POLL_S = 20e-6
_PREFIX = "rollout-fleet-refit/"
_LINGER_S = 5.0  # how long rank 0 keeps a failed rendezvous's store up for the others


def _int_at_least(field: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidValue(field, value, f"must be an int >= {low}")
    return value


class CollectiveGroup:
    """One member of a refit group: the store connection plus, for data ranks, the process group."""

    def __init__(self, *, host: str, port: int, rank: int, world_size: int, train_world_size: int,
                 backend: str, timeout_s: float, store: Any, process_group: Any,
                 data_rank: int | None, every_rank: bool = False) -> None:
        self.host, self.port = host, port
        self.rank, self.world_size, self.train_world_size = rank, world_size, train_world_size
        self.backend, self.timeout_s = backend, timeout_s
        self.data_rank = data_rank
        self.every_rank = every_rank
        self.data_size = world_size if every_rank else 1 + world_size - train_world_size
        self._store = store
        self._pg = process_group
        self.broken: str | None = None  # why the group can no longer be used, once a step failed

    @property
    def is_sender(self) -> bool:
        return self.data_rank == 0

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def received_whole(self, buckets: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``buckets`` passed through; a receiver that stops before the last one (its consumer
        failed or left) leaves the group broken: the senders' later buckets are unread."""
        finished = False
        try:
            yield from buckets
            finished = True
        finally:
            if not finished and not self.broken:
                self.broken = "the receiver stopped before the last bucket"

    def check_usable(self) -> None:
        if self._pg is None and self.data_rank is not None:
            raise RefitError(f"refit group rank {self.rank}: the group is closed")
        if self.broken:
            raise RefitError(f"refit group rank {self.rank}: the group failed earlier ({self.broken});"
                             " form a new group before the next refit")

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from data rank 0; returns the work handle."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self.timeout
        return self._pg.broadcast([tensor], opts)

    def send(self, tensor: torch.Tensor, to_data_rank: int) -> Any:
        """Start a point-to-point send; returns the work handle."""
        return self._pg.send([tensor], to_data_rank, 0)

    def recv(self, tensor: torch.Tensor, from_data_rank: int) -> Any:
        """Start a point-to-point receive into ``tensor``; returns the work handle."""
        return self._pg.recv([tensor], from_data_rank, 0)

    def all_reduce_sum(self, tensor: torch.Tensor) -> Any:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = self.timeout
        return self._pg.allreduce([tensor], opts)

    def wait(self, work: Any, what: str) -> None:
        """Wait for one collective, bounded by the group's timeout; a failure breaks the group."""
        try:
            if self.backend == "nccl":
                self._wait_on_device(work, what)
            else:
                work.wait(self.timeout)
        except RefitError:
            raise
        except Exception as exc:  # torch raises RuntimeError / DistError subclasses
            raise self.fail(what, exc) from exc

    def _wait_on_device(self, work: Any, what: str) -> None:
        """NCCL: poll the work's completion (a CUDA event query, microseconds) against the
        deadline, then order this stream after it. ``work.wait(timeout)`` polls in steps of a
        millisecond: a bucket that takes less than that idled the pipeline (measured on H200s:
        64 MiB buckets, 2 in flight, reached 0.46 of a flat broadcast)."""
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise self.fail(what, f"not complete after {self.timeout_s:g}s")
            time.sleep(_DEVICE_POLL_S)
        work.wait()

    def fail(self, what: str, exc: BaseException | str) -> RefitError:
        detail = exc if isinstance(exc, str) else first_line(exc)
        self.broken = f"{what}: {detail}"
        return RefitError(f"refit group rank {self.rank} of {self.world_size}: {what} failed"
                          f" within the {self.timeout_s:g}s timeout: {detail}")

    def close(self) -> None:
        """Release the process group and the store; safe to repeat."""
        pg, self._pg = self._pg, None
        if pg is not None and self.backend == "nccl":
            # abort() does not wait for a peer that may be gone; shutdown() would.
            getattr(pg, "abort", getattr(pg, "shutdown", lambda: None))()
        self._store = None
        if self.broken is None:
            self.broken = "closed"


def own_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (the store's): the address gloo binds
    its pairs to and other ranks connect to. The store's host itself on rank 0's node (and on
    one machine); a worker on another node gets its own node's address, not rank 0's. No
    packet is sent: connecting a UDP socket only picks the route."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError as exc:
            raise RefitError(f"refit group: no route from this node to the group's host {host}:"
                             f" {exc}") from exc
        return probe.getsockname()[0]


def init_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
               timeout_s: float = 60.0, *, train_world_size: int | None = None,
               every_rank: bool = False) -> CollectiveGroup:
    """Join the refit group as ``rank`` of ``world_size``.

    Trainer ranks are ``0..train_world_size-1``; every other rank is a worker rank. Rank 0's
    ``train_world_size`` (default 1) is the group's; a worker rank may leave it None to adopt
    rank 0's, or give it to have it checked. Rank 0 hosts the store at ``host:port``
    (``port=0`` picks a free one, read back from ``group.port``).
    Every step (reaching the store, waiting for the other ranks, forming the process group) is
    bounded by ``timeout_s``. ``every_rank``: every rank is a data rank (its group rank), as a
    sharded refit needs; all ranks must say the same.
    """
    _int_at_least("world_size", world_size, 2)
    if train_world_size is None and rank == 0:
        train_world_size = 1
    if train_world_size is not None:
        _check_train_world_size(train_world_size, world_size)
    _int_at_least("rank", rank, 0)
    if rank >= world_size:
        raise InvalidValue("rank", rank, f"must be < world_size ({world_size})")
    if backend not in BACKENDS:
        raise InvalidValue("backend", backend, f"must be one of {', '.join(BACKENDS)}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise InvalidValue("timeout_s", timeout_s, "must be a number of seconds > 0")
    _int_at_least("port", port, 0 if rank == 0 else 1)

    deadline = time.monotonic() + timeout_s
    timeout = datetime.timedelta(seconds=timeout_s)
    listen_socket = _listen_on(host, port) if rank == 0 else None
    if listen_socket is not None:
        port = listen_socket.getsockname()[1]
    try:
        store = _connect_store(host, port, rank, timeout, listen_socket)
    finally:
        if listen_socket is not None:
            listen_socket.close()  # the store listens on its own duplicate
    try:
        declaration = {"world_size": world_size, "train_world_size": train_world_size,
                       "backend": backend, "every_rank": bool(every_rank)}
        train_world_size = _rendezvous(store, rank, world_size, declaration, deadline, timeout_s)
        data_rank = rank if every_rank else _data_rank(rank, train_world_size)
        data_size = world_size if every_rank else 1 + world_size - train_world_size
        pg = None
        if data_rank is not None:
            pg = _process_group(store, backend, host, data_rank, data_size, timeout, rank,
                                timeout_s)
    except BaseException:
        store = None  # closes the store's listening socket (from its own thread)
        raise
    return CollectiveGroup(host=host, port=port, rank=rank, world_size=world_size,
                           train_world_size=train_world_size, backend=backend,
                           timeout_s=timeout_s, store=store,
                           process_group=pg, data_rank=data_rank, every_rank=bool(every_rank))


def _listen_on(host: str, port: int) -> socket.socket:
    """Rank 0 binds the store's socket itself: TCPStore would listen on every interface."""
    listen_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listen_socket.bind((host, port))
    except OSError as exc:
        listen_socket.close()
        raise RefitError(f"refit group rank 0 could not listen on {host}:{port}: {exc}") from exc
    listen_socket.listen(128)
    return listen_socket


def _check_train_world_size(train_world_size: Any, world_size: int) -> None:
    _int_at_least("train_world_size", train_world_size, 1)
    if train_world_size >= world_size:
        raise InvalidValue("train_world_size", train_world_size,
                           f"must leave at least one worker rank in world_size={world_size}")


def _data_rank(rank: int, train_world_size: int) -> int | None:
    if rank == 0:
        return 0
    if rank < train_world_size:
        return None
    return rank - train_world_size + 1


def _connect_store(host: str, port: int, rank: int, timeout: datetime.timedelta,
                   listen_socket: socket.socket | None) -> Any:
    try:
        if listen_socket is not None:
            # The store's server closes the descriptor it is given, from its own thread and at
            # a moment of its choosing: it gets a duplicate, so that no number is closed twice
            # (a second close would hit whatever file another thread opened there meanwhile).
            return dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False,
                                 master_listen_fd=os.dup(listen_socket.fileno()))
        return dist.TCPStore(host, port, None, False, timeout)
    except Exception as exc:
        raise RefitError(f"refit group rank {rank} could not reach the group's store at"
                         f" {host}:{port} within {timeout.total_seconds():g}s:"
                         f" {first_line(exc)}") from exc


def _key(name: str) -> str:
    return _PREFIX + name


def _rendezvous(store: Any, rank: int, world_size: int, declaration: dict, deadline: float,
                timeout_s: float) -> int:
    """Declare this rank, wait for every rank of the world or for any objection; returns T.

    On failure every rank acknowledges it, and rank 0 keeps the store up until the ranks that
    joined have read why (bounded), so they get the same error rather than a lost connection.
    """
    try:
        store.add(_key("joined"), 1)
        return _declare_and_wait(store, rank, world_size, declaration, deadline, timeout_s)
    except RefitError:
        _acknowledge_failure(store, rank, world_size, deadline, timeout_s)
        raise
    except Exception as exc:  # the store itself failed: rank 0 is gone
        raise RefitError(f"refit group rank {rank}: the group's store went away during the"
                         f" rendezvous: {first_line(exc)}") from exc


def _acknowledge_failure(store: Any, rank: int, world_size: int, deadline: float,
                         timeout_s: float) -> None:
    try:
        store.add(_key("acknowledged"), 1)
        if rank != 0:
            return
        # Wait for every rank of rank 0's world, also those still starting, but not for long;
        # once the join deadline has passed, no one else comes: those that joined are enough.
        linger_until = time.monotonic() + min(_LINGER_S, timeout_s)
        while time.monotonic() < linger_until:
            acknowledged = store.add(_key("acknowledged"), 0)
            if acknowledged >= world_size or (time.monotonic() > deadline
                                              and acknowledged >= store.add(_key("joined"), 0)):
                return
            time.sleep(_POLL_S)
    except Exception:  # best effort: the error being raised is what matters
        pass


def _declare_and_wait(store: Any, rank: int, world_size: int, declaration: dict, deadline: float,
                      timeout_s: float) -> int:
    key = _key
    if store.add(key(f"claim/{rank}"), 1) > 1:
        _object(store, key, f"rank {rank} was claimed by two processes")
        raise RefitError(f"refit group: rank {rank} was claimed by another process already")
    if rank != 0:
        # Compare with rank 0 before declaring: a rank that disagrees never completes the
        # others' set of declarations, it objects, so nobody goes ahead without it.
        _wait_keys(store, key, [key("declared/0")], rank, deadline, timeout_s, world_size)
        leader = json.loads(store.get(key("declared/0")))
        if declaration["train_world_size"] is None:
            adopted = declaration["train_world_size"] = leader["train_world_size"]
            if rank < adopted:
                _object(store, key, f"rank {rank} is a trainer rank but gave no train_world_size")
        if leader != declaration:
            diffs = _differences(leader, declaration)
            _object(store, key, f"rank {rank} declared {diffs}")
            error_type = WorldSizeMismatch if "world_size" in diffs else RefitError
            raise _mismatch(error_type, rank, f"rank 0 declared {leader}; rank {rank} declared"
                            f" {diffs}")
    store.set(key(f"declared/{rank}"), json.dumps(declaration))
    _wait_keys(store, key, [key(f"declared/{r}") for r in range(world_size)], rank, deadline,
               timeout_s, world_size)
    return declaration["train_world_size"]


def _differences(leader: dict, mine: dict) -> str:
    return ", ".join(f"{k}={mine[k]!r}" for k in mine if leader.get(k) != mine[k])


def _mismatch(error_type: type, rank: int, detail: str) -> RefitError:
    if error_type is WorldSizeMismatch:
        return WorldSizeMismatch("world_size", detail, f"the refit group's ranks disagree"
                                 f" (seen by rank {rank})")
    return RefitError(f"refit group: the ranks disagree (seen by rank {rank}): {detail}")


def _object(store: Any, key: Any, message: str) -> None:
    index = store.add(key("objections"), 1)
    store.set(key(f"objection/{index}"), message)


def _wait_keys(store: Any, key: Any, keys: Sequence[str], rank: int, deadline: float,
               timeout_s: float, world_size: int) -> None:
    while True:
        objections = store.add(key("objections"), 0)
        if objections:
            messages = [store.get(key(f"objection/{i}")).decode() for i in range(1, objections + 1)]
            kind = WorldSizeMismatch if any("world_size" in m for m in messages) else RefitError
            raise _mismatch(kind, rank, "; ".join(messages))
        if store.check(list(keys)):
            return
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[-1] for k in keys if not store.check([k])]
            raise RefitError(f"refit group rank {rank}: rank(s) {', '.join(missing)} of world_size"
                             f" {world_size} did not join within {timeout_s:g}s")
        time.sleep(_POLL_S)


def _process_group(store: Any, backend: str, host: str, data_rank: int, data_size: int,
                   timeout: datetime.timedelta, rank: int, timeout_s: float) -> Any:
    prefixed = dist.PrefixStore(_PREFIX + "data/", store)
    try:
        if backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=own_address_towards(host))]
            return ProcessGroupGloo(prefixed, data_rank, data_size, options)
        # A failed NCCL collective should raise here, not kill the worker process.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefixed, data_rank, data_size, options)
    except Exception as exc:
        raise RefitError(f"refit group rank {rank}: forming the {backend} group failed within"
                         f" {timeout_s:g}s: {first_line(exc)}") from exc
