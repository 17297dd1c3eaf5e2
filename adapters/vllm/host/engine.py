"""VllmEngine: the engine port and the refit port over vLLM's AsyncLLM.

One engine owns one vLLM engine in this process's event loop; vLLM runs the model in its own
engine-core and worker processes. Rollouts are token-ID prompts in, every generated token with
its logprob out, exactly as a native ``generate`` would answer them.

The engine is composed of parts around one ``VllmRuntime`` (``runtime.py``: the started engine
and the weights' standing): serving, here; refit (``refit.py``), sleep and wake (``sleep.py``),
colocated refit (``colocated.py``) and reload from disk (``disk_reload.py``), each a class
with its own state. ``VllmEngine`` implements each port by handing the call to its part (the
worker's refit controls call the refit part itself: ``core.engine_ports.refit_target``).

Refits are received inside vLLM's worker processes, where the weights live: each engine rank's
weight-transfer engine (the project's packed protocol, ``transfer_engine.py``, registered with
vLLM by the composition root; or vLLM's own ``nccl`` engine for trainers that speak vLLM's
protocol) joins the trainer's group and loads every bucket as it arrives. This process only
sends the requests (join, refit info) and never holds a weight.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

import attrs
from rollout_fleet.adapters.vllm.host.colocated import VllmColocated
from rollout_fleet.adapters.vllm.host.config import KV_EVENTS_TOPIC, VllmEngineConfig
from rollout_fleet.adapters.vllm.host.convert import (
    check_vocabulary, piece_of, served_rollout, to_sampling_params, to_served,
)
from rollout_fleet.adapters.vllm.host.disk_reload import VllmDiskReload
from rollout_fleet.adapters.vllm.host.refit import VllmRefit
from rollout_fleet.adapters.vllm.host.runtime import VllmRuntime
from rollout_fleet.adapters.vllm.host.sleep import VllmSleep
from rollout_fleet.core.errors import EngineDead, EngineError, EngineRejected
from rollout_fleet.core.checkpoint_check import CheckpointSummary
from rollout_fleet.core.refit import RefitMode
from rollout_fleet.core.rollout import FinishReason, SamplingSpec, ServedRollout
from rollout_fleet.core.sleep_state import DEFAULT_SLEEP_MODE, WAKE_TAGS, SleepState
from rollout_fleet.ports.colocated import ColocatedByPart
from rollout_fleet.ports.engine import (
    SAMPLING_OPTIONS, DiskReloadTarget, EngineFacts, EnginePort, KvEventSource, RefitByPart,
    RolloutPiece, Sleeper,
)

_EARLY_ABORTS_KEPT = 4096


@attrs.define
class _Live:
    """One rollout this adapter is serving."""

    admitted: bool = False  # vLLM knows the request id: an abort can go straight to it
    aborted: bool = False


class VllmEngine(EnginePort, RefitByPart, DiskReloadTarget, Sleeper, ColocatedByPart):
    """The vLLM backend of a rollout-fleet worker: serves rollouts itself and hands refit,
    reload from disk, sleep and colocated refit to its parts (``refit``, ``disk``,
    ``sleeper``, ``colocated``)."""

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self.runtime = VllmRuntime(config)
        self.refit = VllmRefit(self.runtime)
        self.disk = VllmDiskReload(self.runtime)
        self.sleeper = VllmSleep(self.runtime)
        self.colocated = VllmColocated(self.runtime)
        self._live: dict[str, _Live] = {}
        self._early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()

    # -- engine port --------------------------------------------------------------------------
    async def start(self, worker_id: int | str) -> EngineFacts:
        return await self.runtime.start(worker_id)

    def sampling_offered(self) -> frozenset[str]:
        return frozenset(SAMPLING_OPTIONS)  # each is a SamplingParams field of the same name

    async def serve_rollout(
            self, prompt_token_ids: Sequence[int], *, request_id: str, max_new_tokens: int,
            sampling: SamplingSpec, stop_strings: Sequence[str] = (), top_logprobs: int = 0,
            stop_token_ids: Sequence[int] = (), extra_sampling: Mapping[str, Any] | None = None,
            with_logprobs: bool = True) -> ServedRollout:
        """Without logprobs, vLLM's sampler computes none and its front builds none per token,
        as for a request to vLLM's own server that asks for none."""
        with_logprobs = with_logprobs or top_logprobs > 0
        output, prompt_len = await self._final_output(
            prompt_token_ids, request_id, max_new_tokens, sampling, stop_strings, top_logprobs,
            stop_token_ids, extra_sampling, with_logprobs)
        if output is None:  # aborted before it came
            return served_rollout([], [] if with_logprobs else None, FinishReason.ABORT,
                                  prompt_len, self.runtime.standing.version)
        # vLLM labels each step's tokens with the weight version set while it was paused for
        # the swap (``WeightsStanding.commit``): per-token versions, exact whatever the pause
        # mode.
        return to_served(output, prompt_len, self.runtime.standing.version, top_logprobs,
                         with_logprobs)

    async def serve_group(self, prompt_token_ids: Sequence[int], *, request_id: str, n: int,
                          max_new_tokens: int, sampling: SamplingSpec,
                          stop_strings: Sequence[str] = (), top_logprobs: int = 0,
                          stop_token_ids: Sequence[int] = (),
                          extra_sampling: Mapping[str, Any] | None = None,
                          with_logprobs: bool = True, **keywords: Any) -> tuple[ServedRollout, ...]:
        """vLLM's own ``n``: one request (one id, so one abort ends it) whose samples share the
        prompt's prefill; vLLM seeds sample i with the seed + i, the port's
        ``sample_sampling``. Each sample keeps its own logprobs and weight versions. Greedy
        samples are one sample, generated once (vLLM refuses ``n`` > 1 for greedy)."""
        refuse_unknown(keywords)
        if sampling.greedy:
            served = await self.serve_rollout(
                prompt_token_ids, request_id=request_id, max_new_tokens=max_new_tokens,
                sampling=sampling, stop_strings=stop_strings, top_logprobs=top_logprobs,
                stop_token_ids=stop_token_ids, extra_sampling=extra_sampling,
                with_logprobs=with_logprobs)
            return (served,) * n
        with_logprobs = with_logprobs or top_logprobs > 0
        output, prompt_len = await self._final_output(
            prompt_token_ids, request_id, max_new_tokens, sampling, stop_strings, top_logprobs,
            stop_token_ids, {**(extra_sampling or {}), "n": n}, with_logprobs)
        if output is None:
            version = self.runtime.standing.version
            return tuple(served_rollout([], [] if with_logprobs else None, FinishReason.ABORT,
                                        prompt_len, version) for _ in range(n))
        samples = sorted(output.outputs, key=lambda completion: completion.index)
        if len(samples) != n:
            raise EngineError(f"vLLM answered request {request_id!r} with {len(samples)} of its"
                              f" {n} samples")
        version = self.runtime.standing.version
        return tuple(to_served(_one_sample(output, completion), prompt_len, version,
                               top_logprobs, with_logprobs) for completion in samples)

    async def _final_output(self, prompt_token_ids: Sequence[int], request_id: str,
                            max_new_tokens: int, sampling: SamplingSpec,
                            stop_strings: Sequence[str], top_logprobs: int,
                            stop_token_ids: Sequence[int],
                            extra_sampling: Mapping[str, Any] | None,
                            with_logprobs: bool = True) -> tuple[Any, int]:
        """(vLLM's finished output, the prompt's length); no output for a request aborted
        before it came."""
        engine = self.runtime.require_engine()
        prompt = self._admissible(prompt_token_ids, max_new_tokens, stop_token_ids, extra_sampling)
        if self._early_aborts.pop(request_id, "absent") is None:
            return None, len(prompt)
        params = to_sampling_params(sampling, max_new_tokens, stop_strings, top_logprobs,
                                    stop_token_ids, extra_sampling, logprobs=with_logprobs)
        live = self._live[request_id] = _Live()
        try:
            output = await self._generate(engine, prompt, params, request_id, live)
        except Exception as error:
            reason = self.dead_reason()
            if reason is not None:  # not this request's fault: another worker can serve it
                raise EngineDead(reason) from error
            raise
        finally:
            self._live.pop(request_id, None)
        return output, len(prompt)

    async def stream_rollout(self, prompt_token_ids: Sequence[int], *, request_id: str,
                             max_new_tokens: int, sampling: SamplingSpec,
                             stop_strings: Sequence[str] = (), with_logprobs: bool = True,
                             top_logprobs: int = 0, stop_token_ids: Sequence[int] = (),
                             extra_sampling: Mapping[str, Any] | None = None, **keywords: Any
                             ) -> AsyncIterator[RolloutPiece]:
        """A piece per engine step, as vLLM hands out each step's new tokens (its DELTA
        outputs). Without logprobs, vLLM's sampler computes none and its front builds none per
        token, as for a request to vLLM's own server that asks for none."""
        refuse_unknown(keywords)
        engine = self.runtime.require_engine()
        prompt = self._admissible(prompt_token_ids, max_new_tokens, stop_token_ids, extra_sampling)
        if self._early_aborts.pop(request_id, "absent") is None:
            yield RolloutPiece((), (), FinishReason.ABORT)
            return
        with_logprobs = with_logprobs or top_logprobs > 0
        params = to_sampling_params(sampling, max_new_tokens, stop_strings, top_logprobs,
                                    stop_token_ids, extra_sampling, stream=True,
                                    logprobs=with_logprobs)
        live = self._live[request_id] = _Live()
        try:
            async with contextlib.aclosing(self._outputs(engine, prompt, params, request_id,
                                                         live)) as outputs:
                async for output in outputs:  # closed at once if our consumer stops early
                    yield piece_of(output, top_logprobs, with_logprobs)
        except Exception as error:
            reason = self.dead_reason()
            if reason is not None:
                raise EngineDead(reason) from error
            raise
        finally:
            self._live.pop(request_id, None)

    def _admissible(self, prompt_token_ids: Sequence[int], max_new_tokens: int,
                    stop_token_ids: Sequence[int] = (),
                    extra_sampling: Mapping[str, Any] | None = None) -> list[int]:
        self.runtime.standing.check_serving()  # asleep, woken without weights, or torn
        prompt = list(prompt_token_ids)
        self._check_input(prompt, max_new_tokens)
        if stop_token_ids or extra_sampling:
            vocab = self.runtime.engine.model_config.get_vocab_size()
            extra = extra_sampling or {}
            for field, ids in (("stop_token_ids", stop_token_ids),
                               ("allowed_token_ids", extra.get("allowed_token_ids") or ()),
                               ("logit_bias", list(extra.get("logit_bias") or ()))):
                check_vocabulary(field, ids, vocab)
        return prompt

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None:  # not here yet (or long gone): remember, so it ends as soon as it comes
            self._early_aborts[request_id] = None
            while len(self._early_aborts) > _EARLY_ABORTS_KEPT:
                self._early_aborts.popitem(last=False)
            return
        live.aborted = True
        if live.admitted:
            await self.runtime.engine.abort(request_id)

    def progress(self) -> int:
        return self.runtime.steps

    def dead_reason(self) -> str | None:
        return self.runtime.dead_reason()

    def kv_event_sources(self) -> Sequence[KvEventSource]:
        endpoint = self.config.kv_events_endpoint  # None without kv_events_port
        if self.runtime.engine is None or endpoint is None:
            return ()
        if not self.runtime.require_features().kv_event_sources:  # an older vLLM: as it was told
            return (KvEventSource(kind="zmq", endpoint=endpoint, topic=KV_EVENTS_TOPIC),)
        sources = []
        for events in self.runtime.engine.get_kv_event_sources().values():
            if events.enable_kv_cache_events and events.publisher == "zmq":
                sources.append(KvEventSource(
                    kind="zmq", endpoint=events.endpoint.replace("*", "127.0.0.1"),
                    topic=events.topic, replay_endpoint=events.replay_endpoint))
        return tuple(sources)

    async def close(self) -> None:
        """Stop vLLM's engine-core and worker processes; safe to call twice."""
        await self.runtime.close()

    # -- refit port: its ``refit`` part (``refit.py``), through ``RefitByPart`` -----------------

    # -- disk reload port: ``disk_reload.py`` --------------------------------------------------
    async def check_checkpoint(self, path: str) -> CheckpointSummary:
        return await self.disk.check_checkpoint(path)

    async def reload_from_disk(self, path: str, *, mode: RefitMode = RefitMode.KEEP,
                               version: int | None = None, deadline_s: float | None = None) -> int:
        return await self.disk.reload_from_disk(path, mode=mode, version=version,
                                                deadline_s=deadline_s)

    # -- sleep port: ``sleep.py`` -------------------------------------------------------------
    async def sleep(self, level: int = 1, *, mode: str = DEFAULT_SLEEP_MODE) -> SleepState:
        return await self.sleeper.sleep(level, mode=mode)

    async def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> SleepState:
        return await self.sleeper.wake_up(tags)

    def sleep_state(self) -> SleepState:
        return self.runtime.sleep.state

    # -- internals ----------------------------------------------------------------------------
    def _check_input(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise EngineRejected("prompt_token_ids is empty")
        vocab = self.runtime.engine.model_config.get_vocab_size()
        check_vocabulary("prompt_token_ids", prompt, vocab)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise EngineRejected(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
        context = self.runtime.require_facts().context_length
        if len(prompt) + max_new_tokens > context:
            raise EngineRejected(f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} "
                              f"exceeds context_length={context}")

    async def _admit(self, engine: Any, prompt: list[int], params: Any, request_id: str,
                     live: _Live) -> Any:
        from vllm.inputs.engine import tokens_input

        try:
            collector = await engine.add_request(
                request_id, tokens_input(prompt, cache_salt=self.runtime.standing.salt.value),
                params)
        except Exception as error:  # vLLM's validation: name the cause, keep serving
            if self.dead_reason() is not None:
                raise
            raise EngineRejected(f"vLLM refused request {request_id!r}: {error}") from error
        live.admitted = True
        return collector

    async def _generate(self, engine: Any, prompt: list[int], params: Any, request_id: str,
                        live: _Live) -> Any:
        collector = await self._admit(engine, prompt, params, request_id, live)
        try:
            if live.aborted:  # the abort came while vLLM was admitting it
                await engine.abort(request_id)
            while True:
                output = collector.get_nowait() or await collector.get()
                if output.finished:
                    return output
        except asyncio.CancelledError:
            await engine.abort(request_id)
            raise
        finally:
            collector.close()

    async def _outputs(self, engine: Any, prompt: list[int], params: Any, request_id: str,
                       live: _Live) -> AsyncGenerator[Any, None]:
        """Every output vLLM hands out for the request, until the finished one. A consumer
        that stops early (the client left) aborts the request."""
        collector = await self._admit(engine, prompt, params, request_id, live)
        finished = False
        try:
            if live.aborted:
                await engine.abort(request_id)
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:  # cancelled, or the generator was closed mid-way
                await engine.abort(request_id)
            collector.close()


def refuse_unknown(keywords: Mapping[str, Any]) -> None:
    """The port takes any keyword (an engine reads those it knows); this one knows its own."""
    if keywords:
        raise TypeError(f"the vLLM engine takes no option(s) {', '.join(sorted(keywords))}")


def _one_sample(output: Any, completion: Any) -> Any:
    """One sample of a group's output, read as a one-sample output: the group's, with only
    that completion (``to_served`` reads a request's first)."""
    sample = copy.copy(output)
    sample.outputs = [completion]
    return sample
