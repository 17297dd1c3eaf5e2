"""MemoryEngine: a tiny deterministic language model in plain Python behind the engine port.

The model is a factored bigram table: the next-token logits are ``embed[prev] . lm_head[next]``
over a 48-token vocabulary. It has a real softmax, so greedy decoding, seeded sampling, stop
strings, budgets and logprobs are all real, and its two weight matrices can be replaced through
the weight-loading port, which visibly changes what it generates.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.adapters.memory.colocated import MemoryColocated
from rollout_fleet.adapters.memory.model import (
    BALLAST_PREFIX, EOS_TOKEN_ID, HIDDEN, VOCAB, WEIGHT_NAMES, Steering, TinyBigramModel,
    as_matrix, ballast_metas, decode, pick_token,
)
from rollout_fleet.adapters.memory.sleep import MemorySleep
from rollout_fleet.core.errors import EngineDead, EngineRejected, InvalidValue, RefitError
from rollout_fleet.core.refit import (
    DEFAULT_REFIT_MODE,
    GroupJoin,
    RefitInfo,
    RefitMode,
    RefitProtocol,
    TensorMeta,
    next_version,
)
from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout, Usage
from rollout_fleet.core.sleep_state import DEFAULT_SLEEP_MODE, WAKE_TAGS, SleepState
from rollout_fleet.core.validate import is_int
from rollout_fleet.ports.collective import WeightReceiver
from rollout_fleet.ports.colocated import ColocatedByPart
from rollout_fleet.ports.engine import (
    EngineFacts,
    EnginePort,
    KvEventSource,
    RefitTarget,
    RolloutPiece,
    Sleeper,
)

# The model's names are imported from here too (tests, the memory demo, the model folder).
__all__ = ["EOS_TOKEN_ID", "VOCAB", "MemoryEngine", "TinyBigramModel", "decode"]


class MemoryEngine(EnginePort, RefitTarget, Sleeper, ColocatedByPart):
    """The in-memory engine: implements the engine port and the refit port itself, and the
    sleep port and the colocated refit port through its parts (``sleeper``: ``sleep.py``;
    ``colocated``: ``colocated.py``).

    For refits it holds ``refit_ranks`` ranks of the group (as a tensor-parallel engine would),
    each joined through ``join_receiver`` (the composition root's transfer backend: the
    collective adapter's gloo receiver, or the in-memory one in unit tests). Every rank receives
    every byte; rank 0's tensors are loaded once all ranks agree, so a failed transfer changes
    nothing.
    """

    def __init__(self, seed: int = 0, *, context_length: int = 256, token_delay_s: float = 0.0,
                 max_num_seqs: int = 1024, kv_block_size: int = 16, refit_ranks: int = 1,
                 join_receiver: Callable[[GroupJoin, int], WeightReceiver] | None = None,
                 refit_ballast_bytes: int = 0) -> None:
        self.model = TinyBigramModel.from_seed(seed)
        self.context_length = context_length
        self.token_delay_s = token_delay_s
        self._facts = EngineFacts(
            context_length=context_length, kv_block_size=kv_block_size,
            total_kv_blocks=max_num_seqs * context_length // kv_block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=context_length * 8,
        )
        self._version = 0
        self._aborted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._groups: dict[str, int] = {}  # groups being served: their sizes
        self.in_flight: set[str] = set()
        self._live_tokens: dict[str, int] = {}  # request id -> tokens it holds (prompt + generated)
        self.served_count = 0
        self.generated_tokens = 0  # every token it has generated (its worker's metrics)
        self.aborted_ids: list[str] = []  # ids whose abort reached the engine (tests read it)
        self.started_as: int | str | None = None
        self.cache_resets = 0  # how often the cache was invalidated (tests read it)
        self._refit_ranks = refit_ranks
        self._ballast = ballast_metas(refit_ballast_bytes)  # received and dropped (model.py)
        self._join_receiver = join_receiver
        self._receivers: list[WeightReceiver] = []
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._dead: str | None = None  # why it died (``die``): it serves nothing more
        self._running = asyncio.Event()  # cleared by ``freeze``: no request takes a step
        self._running.set()
        self._steps = 0  # tokens generated, all requests together (``progress``)
        # request id -> where each token goes as it is picked (a streamed rollout's queue)
        self._token_sinks: dict[str, Callable[[tuple], None]] = {}
        self.sleeper = MemorySleep(self)
        self.colocated = MemoryColocated(self)

    # -- engine port --------------------------------------------------------------------------
    async def start(self, worker_id: int | str) -> EngineFacts:
        self.started_as = worker_id
        return self._facts

    async def serve_rollout(self, prompt_token_ids: Sequence[int], *, request_id: str,
                            max_new_tokens: int, sampling: SamplingSpec,
                            stop_strings: Sequence[str] = (), top_logprobs: int = 0,
                            stop_token_ids: Sequence[int] = (),
                            extra_sampling: Mapping[str, Any] | None = None,
                            with_logprobs: bool = True) -> ServedRollout:
        self._check_alive()
        if not self.sleeper.serving_gate.is_set():
            self.sleeper.check_serving()  # asleep: refused, retryable (EngineAsleep)
        self._check_input(prompt_token_ids, max_new_tokens)
        if not is_int(top_logprobs) or not 0 <= top_logprobs <= len(VOCAB):
            raise EngineRejected(f"top_logprobs={top_logprobs!r}: must be an int in 0..{len(VOCAB)}")
        rng = random.Random(sampling.seed) if sampling.seed is not None else random.Random()
        await self._admitting.wait()  # closed only while a drain-mode refit swaps
        self.in_flight.add(request_id)
        try:
            served = await self._generate(prompt_token_ids, request_id, max_new_tokens, sampling,
                                          tuple(stop_strings), rng, top_logprobs,
                                          Steering.of(extra_sampling or {}, stop_token_ids))
            self.generated_tokens += len(served.token_ids)
            return served if with_logprobs else attrs.evolve(served, logprobs=None)
        finally:
            self.in_flight.discard(request_id)
            self._live_tokens.pop(request_id, None)
            self._aborted.pop(request_id, None)
            self.served_count += 1

    def sampling_offered(self) -> frozenset[str]:
        return Steering.OFFERED

    async def stream_rollout(self, prompt_token_ids: Sequence[int], *, request_id: str,
                             with_logprobs: bool = True, **keywords: Any
                             ) -> AsyncIterator[RolloutPiece]:
        """Each token as it is picked (the alternatives, when asked, come with the last piece
        only: they are not streamed here), then the finish; without its logprob when none are
        wanted."""
        picked: asyncio.Queue = asyncio.Queue()
        self._token_sinks[request_id] = picked.put_nowait
        serving = asyncio.ensure_future(self.serve_rollout(prompt_token_ids, request_id=request_id,
                                                           **keywords))
        serving.add_done_callback(lambda _: picked.put_nowait(None))
        try:
            if keywords.get("top_logprobs"):
                yield RolloutPiece.whole(await serving)
                return
            while (step := await picked.get()) is not None:
                yield RolloutPiece((step[0],), (step[1],) if with_logprobs else ())
            served = await serving
            yield RolloutPiece((), (), served.finish_reason, weight_versions=served.weight_versions)
        finally:
            self._token_sinks.pop(request_id, None)
            serving.cancel()

    async def serve_group(self, prompt_token_ids: Sequence[int], *, request_id: str, n: int,
                          **keywords: Any) -> tuple[ServedRollout, ...]:
        """The port's n rollouts (``request_id/i``); an abort of ``request_id`` ends them all."""
        self._groups[request_id] = n
        try:
            return await super().serve_group(prompt_token_ids, request_id=request_id, n=n,
                                             **keywords)
        finally:
            self._groups.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self.aborted_ids.append(request_id)
        samples = [f"{request_id}/{index}" for index in range(self._groups.get(request_id, 0))]
        for each in (request_id, *samples):
            self._aborted[each] = None
        while len(self._aborted) > 4096:  # remember early aborts, but not forever
            self._aborted.popitem(last=False)

    def kv_event_sources(self) -> Sequence[KvEventSource]:
        return ()

    def die(self, reason: str = "killed") -> None:
        """A fault drill: the engine dies as a crashed engine process would. Rollouts in
        flight fail at their next token, and every later one at once, with ``EngineDead``."""
        self._dead = f"the memory engine died ({reason})"

    def freeze(self) -> None:
        """A fault drill: the engine hangs as a wedged engine process would (alive, silent).
        Rollouts in flight stop at their next token, later ones at their first; nothing fails
        and ``progress`` stands still."""
        self._running.clear()

    def progress(self) -> int:
        return self._steps

    def dead_reason(self) -> str | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)

    def kv_cache_usage(self) -> float:
        """Blocks the in-flight requests would hold, over the engine's KV capacity (0..1)."""
        size = self._facts.kv_block_size
        blocks = sum(-(-tokens // size) for tokens in self._live_tokens.values())
        return min(1.0, blocks / self._facts.total_kv_blocks)

    # -- refit port ---------------------------------------------------------------------------
    def weight_metas(self) -> Mapping[str, TensorMeta]:
        return {**{name: TensorMeta(name, (len(VOCAB), HIDDEN), "float32")
                   for name in WEIGHT_NAMES}, **self._ballast}

    def refit_ranks(self) -> int:
        return self._refit_ranks

    async def init_collective(self, join: GroupJoin) -> None:
        if join.ranks_per_worker != self._refit_ranks:
            raise InvalidValue("ranks_per_worker", join.ranks_per_worker,
                               f"this engine holds {self._refit_ranks} rank(s)")
        if join.sender_spec.protocol is not RefitProtocol.PACKED:
            raise InvalidValue("sender_spec.protocol", join.sender_spec.protocol.value,
                               f"the memory engine receives refits in {RefitProtocol.PACKED.value!r}"
                               " only")
        join_receiver = self._join_receiver
        if join_receiver is None:
            raise RefitError("this memory engine was built without a transfer backend (join_receiver)")
        self.close_receivers()
        self._receivers = await _all_ranks(
            [functools.partial(join_receiver, join, j) for j in range(self._refit_ranks)],
            on_partial=lambda joined: [r.close() for r in joined])

    async def update_weights(self, info: RefitInfo, *, mode: RefitMode = DEFAULT_REFIT_MODE,
                             version: int | None = None) -> int:
        """Receive on every rank, then swap between two tokens. ``drain`` holds new rollouts
        and lets those in flight finish first; ``keep`` and ``recompute`` swap under them
        (this model has no KV cache, so the two are the same here)."""
        if not self._receivers:
            raise RefitError("update_weights before init_collective")
        metas = self.weight_metas()
        info.check_against(metas)
        self.sleeper.check_refit_allowed([t.name for t in info.tensors])
        received = await _all_ranks([functools.partial(_kept_tensors, r, info)
                                     for r in self._receivers])
        staged = {name: as_matrix(name, tensor, metas[name]) for name, tensor in received[0]}
        for rank, tensors in enumerate(received[1:], start=1):
            if {name: as_matrix(name, t, metas[name]) for name, t in tensors} != staged:
                raise RefitError(f"engine rank {rank} received other bytes than rank 0")
        return await self.swap_weights(staged, mode, version)

    async def swap_weights(self, staged: Mapping[str, list[list[float]]], mode: RefitMode,
                            version: int | None) -> int:
        """Every refit, collective or colocated, ends here: swap, reset the cache, version."""
        async with self._drained() if mode == "drain" else contextlib.nullcontext():
            self.model.embed = staged.get("embed.weight", self.model.embed)
            self.model.lm_head = staged.get("lm_head.weight", self.model.lm_head)
            await self.reset_cache()
            self._version = next_version(self._version, version)
            self.sleeper.loaded_by_refit()
        return self._version

    @contextlib.asynccontextmanager
    async def _drained(self):
        """New rollouts wait at the door; those in flight finish; the block runs; doors open."""
        self._admitting.clear()
        try:
            while self.in_flight:
                await asyncio.sleep(0.001)
            yield
        finally:
            self._admitting.set()

    def close_receivers(self) -> None:
        receivers, self._receivers = self._receivers, []
        for receiver in receivers:
            receiver.close()

    def weight_version(self) -> int:
        return self._version

    async def reset_cache(self) -> None:
        self.model.clear_cache()
        self.cache_resets += 1

    # -- sleep port: ``sleep.py`` -------------------------------------------------------------
    async def sleep(self, level: int = 1, *, mode: str = DEFAULT_SLEEP_MODE) -> SleepState:
        return await self.sleeper.sleep(level, mode=mode)

    async def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> SleepState:
        return await self.sleeper.wake_up(tags)

    def sleep_state(self) -> SleepState:
        return self.sleeper.sleep_state()

    def resident(self) -> dict[str, bool]:
        return self.sleeper.resident()

    def sleep_stats(self) -> Mapping[str, Any]:
        return self.sleeper.sleep_stats()

    # -- internals ----------------------------------------------------------------------------
    def _check_input(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        if not prompt:
            raise EngineRejected("prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < len(VOCAB)]  # typed where it entered
        if bad:
            raise EngineRejected(f"prompt_token_ids has IDs outside the vocabulary [0, {len(VOCAB)}): {bad[:5]}")
        if max_new_tokens < 1:
            raise EngineRejected(f"max_new_tokens={max_new_tokens}: must be >= 1")
        if len(prompt) + max_new_tokens > self.context_length:
            raise EngineRejected(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds "
                f"context_length={self.context_length}")

    async def _generate(self, prompt, request_id, max_new_tokens, sampling, stop_strings, rng,
                        top_n, steering: "Steering"):
        tokens: list[int] = []
        logprobs: list[float] = []
        tops: list[tuple[tuple[int, float], ...]] = []
        text = ""
        finish = FinishReason.LENGTH
        versions: list[list[int]] = []  # [version, n_tokens] runs: a load mid-rollout starts a run
        prev = prompt[-1]
        for step in range(max_new_tokens):
            if self.token_delay_s > 0:
                await asyncio.sleep(self.token_delay_s)
            elif step % 8 == 0:
                await asyncio.sleep(0)  # let aborts and other requests in
            if not self._running.is_set():
                await self._running.wait()  # frozen: never set again
            if not self.sleeper.serving_gate.is_set():  # kept by a sleep: continues after the wake
                await self.sleeper.serving_gate.wait()
            self._check_alive()
            if request_id in self._aborted:
                finish = FinishReason.ABORT
                break
            row = self.model.logprobs_after(prev)
            token = pick_token(steering.steered(row, step), sampling, rng)
            tokens.append(token)
            logprobs.append(row[token])
            sink = self._token_sinks.get(request_id)
            if sink is not None:
                sink((token, row[token]))
            if top_n:
                best = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:top_n]
                tops.append(tuple((t, row[t]) for t in best))
            if versions and versions[-1][0] == self._version:
                versions[-1][1] += 1
            else:
                versions.append([self._version, 1])
            self._live_tokens[request_id] = len(prompt) + len(tokens)
            self._steps += 1
            prev = token
            if token in steering.stop_ids:
                finish = FinishReason.STOP
                break
            text += VOCAB[token]
            if any(stop in text for stop in stop_strings):
                finish = FinishReason.STOP
                break
        return ServedRollout(tokens, logprobs, finish, Usage(len(prompt), len(tokens)),
                             weight_version=self._version, weight_versions=versions,
                             top_logprobs=tuple(tops) if top_n else None)


def _kept_tensors(receiver: WeightReceiver, info: RefitInfo) -> list[tuple[str, Any]]:
    """What one rank receives, ballast dropped as it arrives."""
    return [(name, tensor) for name, tensor in receiver.receive(info)
            if not name.startswith(BALLAST_PREFIX)]


async def _all_ranks(calls: list[Callable[[], Any]], on_partial: Callable[[list], Any] | None = None
                     ) -> list[Any]:
    """Run one blocking call per rank in threads; every result, or the first error (after
    handing the successful results to ``on_partial``)."""
    loop = asyncio.get_running_loop()
    # A thread per rank: ranks block until every rank of the group is there, so a shared pool
    # smaller than the group would wait for itself.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(calls))
    try:
        results = await asyncio.gather(*(loop.run_in_executor(pool, call) for call in calls),
                                       return_exceptions=True)
    finally:
        # Not waited for: a refit abandoned at its deadline must not hold the worker's loop
        # until a stalled rank gives up; what that rank still receives is dropped.
        pool.shutdown(wait=False)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        if on_partial is not None:
            on_partial([r for r in results if not isinstance(r, BaseException)])
        raise errors[0]
    return results
