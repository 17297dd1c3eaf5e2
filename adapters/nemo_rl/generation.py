"""FleetGeneration: NeMo-RL's generation interface over a Dynamo fleet.

Torch tensors live only at this edge; inside, prompts become the core's RolloutRequests, the
core's rollout client sends them (retrying transient failures) through the completions port,
and each answer is assembled into the contract's tensors as soon as it arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from rollout_fleet.adapters.nemo_rl.colocated import ColocatedPhases
from rollout_fleet.adapters.nemo_rl.batch import grouped, like, read_batch, sample_output, seeded_for
from rollout_fleet.adapters.nemo_rl.config import GenerationConfig
from rollout_fleet.adapters.nemo_rl.hold import GenerationHold
from rollout_fleet.adapters.nemo_rl.membership import FleetMembership, JoinedWorker
from rollout_fleet.adapters.nemo_rl.refit import FleetRefit
from rollout_fleet.adapters.nemo_rl.worker_metrics import MetricTimelines
from rollout_fleet.core.clock import Clock
from rollout_fleet.core.errors import InvalidValue, RolloutFleetError, WireError, WorkerFailures
from rollout_fleet.core.loop_thread import LoopThread
from rollout_fleet.core.refit import CollectiveSenderSpec
from rollout_fleet.core.refit_service import RefitCoordinator
from rollout_fleet.core.rollout import GREEDY, RolloutRequest, RolloutResult
from rollout_fleet.core.rollout_client import RolloutClient, RolloutLimits
from rollout_fleet.core.sleep_state import SleepState
from rollout_fleet.core.staleness import StalenessGate
from rollout_fleet.ports.completions import CompletionsTransport
from rollout_fleet.ports.control import WorkerControl
from rollout_fleet.ports.metrics import WorkerLoad, WorkerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


class FleetGeneration:
    """A drop-in generation backend with the shape of NeMo-RL's ``GenerationInterface``.

    Owns (and stops at ``shutdown``) only what it was handed in ``owned``: the fleet, when
    built from one. A pickled copy keeps the config, the frontend URL and the workers' control
    endpoints (with the secret); it generates and invalidates caches, owns nothing, and its
    ``shutdown`` releases only its own connections.
    """

    def __init__(self, config: GenerationConfig, *, frontend_url: str,
                 transport: CompletionsTransport, controls: Sequence[WorkerControl],
                 metrics: Sequence[WorkerMetrics] = (), owned: Sequence[Any] = (),
                 clock: Clock | None = None,
                 lost_workers: Callable[[], Collection[str]] | None = None,
                 joined_workers: Callable[[Collection[str]], Sequence[JoinedWorker]] | None = None,
                 ) -> None:
        if not isinstance(config, GenerationConfig):
            raise InvalidValue("config", type(config).__name__, "must be a GenerationConfig")
        self.config = config
        self.frontend_url = frontend_url
        self._transport = transport
        self._owned = tuple(owned)
        self.is_copy = False
        self._limits = RolloutLimits(config.max_model_len, config.max_new_tokens,
                                     config.stop_strings, config.context_limit_policy,
                                     config.stop_token_ids)
        self._sampling = config.sampling
        self._client = RolloutClient(transport, model=config.model, retry=config.retry, clock=clock)
        self._refit = RefitCoordinator(controls, ranks_per_worker=config.ranks_per_worker,
                                       timeout_s=config.control_timeout_s,
                                       relay_width=config.control_relay_width)
        self._helper = LoopThread("dynamo-generation", timeout_s=None)
        self._colocated = ColocatedPhases(
            controls, config.colocated_workers, level=config.sleep_level,
            mode=config.sleep_mode, timeout_s=config.control_timeout_s, run=self._helper.run)
        self._id_prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self._gate = StalenessGate(config.max_staleness)
        self._fleet_refit = FleetRefit(self._refit, self._helper, config.sender_spec, self._gate)
        self._metrics = MetricTimelines(metrics, self._helper,
                                        interval_s=config.metrics_interval_s)
        self._metrics.start()  # once, here: not a step of every rollout
        self._members = FleetMembership(controls, refit=self._refit, colocated=self._colocated,
                                        metrics=self._metrics, lost_workers=lost_workers,
                                        joined_workers=joined_workers)
        self._hold = GenerationHold(self.invalidate_kv_cache, self.retried_attempts)
        self._shut_down = False

    # -- generation ---------------------------------------------------------------------------
    def generate(self, data: Any, greedy: bool = False) -> Any:
        raise NotImplementedError("FleetGeneration has no blocking generate(): use `async for "
                                  "index, sample in generation.generate_async(data, greedy)`")

    async def generate_async(self, data: Any, greedy: bool = False
                             ) -> AsyncIterator[tuple[int, Any]]:
        """Yield ``(sample_index, one-sample output)`` as each rollout finishes."""
        self._check_open()
        if not isinstance(greedy, bool):
            raise InvalidValue("greedy", greedy, "must be a bool")
        batch = read_batch(data)
        requests = self._requests(batch, GREEDY if greedy else self._sampling)
        semaphore = self._semaphore()
        finished: asyncio.Queue = asyncio.Queue()
        units = grouped(requests)  # a GRPO group's repeated prompt: one request of n samples
        pending = iter(units)

        async def send_until_done() -> None:
            # A few long-lived senders instead of one task per sample: less loop overhead per
            # rollout. The semaphore still bounds every generate_async on this loop together.
            for index, request in pending:
                try:
                    async with semaphore:
                        results = await self._rollout(request)
                except Exception as exc:  # handed to the consumer, which raises it
                    finished.put_nowait((index, exc))
                    return
                for offset, result in enumerate(results):
                    finished.put_nowait((index + offset, result))

        senders = [asyncio.ensure_future(send_until_done())
                   for _ in range(min(self.config.max_in_flight, len(units)))]
        try:
            for _ in range(len(requests)):
                index, result = await finished.get()
                if isinstance(result, BaseException):
                    raise result
                self._check_result(index, batch.prompts[index], requests[index], result)
                yield index, like(data, sample_output(batch.prompts[index], result))
        finally:
            for sender in senders:
                sender.cancel()

    async def _rollout(self, request: RolloutRequest) -> tuple[RolloutResult, ...]:
        """A request's results (a group's n), held by a pause (NeMo-RL's) and by the staleness bound."""
        if not self._hold.open.is_set():
            await self._hold.wait_until_open()
        if not self._gate.bounded:
            return await self._client.results(request)
        async with self._gate.rollout():
            return await self._client.results(request)

    def _requests(self, batch, sampling) -> list[RolloutRequest]:
        requests = []
        for index, (prompt, stops) in enumerate(zip(batch.prompts, batch.stop_strings)):
            number = next(self._ids)
            try:
                requests.append(self._limits.request(  # the batch's prompts were checked
                    f"rollout-{self._id_prefix}-{number}", prompt,  # by read_batch
                    sampling=seeded_for(sampling, number), stop_strings=stops,
                    prompt_checked=True))
            except InvalidValue as exc:
                raise type(exc)(f"sample {index}: {exc.field}", exc.value, exc.rule) from None
        return requests

    def _check_result(self, index: int, prompt: list[int], request: RolloutRequest,
                      result: RolloutResult) -> None:
        """The fleet must stay within the budget and the context window it was given."""
        generated = len(result.token_ids)
        if generated > request.max_new_tokens or len(prompt) + generated > self.config.max_model_len:
            raise WireError(
                f"sample {index} ({request.request_id}): the fleet returned {generated} tokens "
                f"for a budget of {request.max_new_tokens} after a {len(prompt)}-token prompt "
                f"(max_model_len={self.config.max_model_len})")

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.get(loop)
        if semaphore is None:
            for dead in [lp for lp in self._semaphores if lp.is_closed()]:
                del self._semaphores[dead]
            semaphore = self._semaphores[loop] = asyncio.Semaphore(self.config.max_in_flight)
        return semaphore

    # -- lifecycle ----------------------------------------------------------------------------
    def invalidate_kv_cache(self, *args: Any, **kwargs: Any) -> bool:
        """Flush every worker's prefix/KV cache; WorkerFailures names each worker that failed."""
        self._check_open()
        self._on_survivors(lambda: self._helper.run(self.ainvalidate_kv_cache()))
        return True

    async def ainvalidate_kv_cache(self) -> bool:
        await self._refit.invalidate_caches()
        return True

    def shutdown(self) -> bool:
        """Stop what this driver owns (safe to repeat); a copy stops nothing but its connections."""
        if self._shut_down:
            return True
        self._shut_down = True
        self._metrics.stop()
        if self._helper.started:
            try:
                self._helper.run(self._close_connections(), timeout_s=30)
            except Exception as exc:  # closing sockets must not keep the fleet from stopping
                log.warning("closing the driver's connections failed: %s", exc)
        self._helper.close()
        self._fleet_refit.close()
        for thing in self._owned:
            thing.stop()
        return True

    async def _close_connections(self) -> None:
        await self._transport.aclose()
        for closeable in {id(c): c for c in (*self._members.controls,
                                             *self._metrics.sources)}.values():
            clients = getattr(closeable, "clients", None)
            if clients is not None:
                await clients.aclose()

    def _check_open(self) -> None:
        if self._shut_down:
            raise RolloutFleetError("this FleetGeneration was shut down")

    def _on_survivors(self, step: Callable[[], T]) -> T:
        """``step()`` over every worker; one that failed only on workers the fleet reports lost
        runs again without them (membership.py: the fleet is asked only after a failure)."""
        try:
            return step()
        except WorkerFailures as failed:
            if not self._members.left_out_after(failed):
                raise
        return step()

    # -- facts --------------------------------------------------------------------------------
    @property
    def worker_ids(self) -> tuple[str, ...]:
        return self._members.worker_ids

    def forget_workers(self, worker_ids: Collection[str]) -> tuple[str, ...]:
        """Leave lost workers out of every later refit, cache flush and metrics sample: the next
        ``init_collective`` forms the group with the survivors (world size shrinks, ranks are
        laid out again). A fleet that reports its lost workers has this done where the trainer
        forms its group and after a step failed on one (membership.py)."""
        return self._members.forget(worker_ids)

    def add_workers(self, workers: Sequence[JoinedWorker]) -> tuple[str, ...]:
        """Workers that joined the running fleet (a replacement, or one more): the next
        ``init_collective`` forms the group with them too (world size grows), and the next
        update loads the current weights on them, before which they serve nothing. A fleet
        that reports who joined has this done in ``get_inference_world_size``."""
        return self._members.add(workers)

    def get_inference_world_size(self) -> int:
        """Ranks of the live workers: lost ones left out, those that joined taken in (what the
        trainer asks before it forms the group)."""
        self._members.forget_lost()
        self._members.take_in_joined()
        return len(self._members.controls) * self.config.ranks_per_worker

    def get_collective_sender_spec(self) -> CollectiveSenderSpec:
        return self.config.sender_spec

    # -- metrics ------------------------------------------------------------------------------
    def retried_attempts(self) -> dict[str, int]:
        """Attempts sent again, by cause (HTTP status or error type): each may re-run work."""
        return dict(self._client.retried)

    def get_logger_metrics(self) -> dict[str, dict[str, list[tuple[float, float]]]]:
        """Per-worker timelines ``{quantity: {worker_id: [(seconds since start, value), ...]}}``."""
        return self._metrics.timelines()

    def clear_logger_metrics(self) -> None:
        self._metrics.clear()

    def drain_latest_logger_metrics(self) -> dict[str, dict[str, list[tuple[float, float]]]]:
        return self._metrics.drain_latest()

    def snapshot_step_metrics(self) -> None:
        self._hold.snapshot_step_metrics()

    def get_step_metrics(self) -> dict[str, float]:  # retried attempts since the snapshot
        return self._hold.step_metrics()

    def sample_worker_metrics(self) -> list[WorkerLoad]:
        """Take one sample of every worker now (also what the periodic sampler does)."""
        self._check_open()
        return self._metrics.sample_now()

    # -- colocated phases: the workers that share devices with trainer ranks -------------------
    def prepare_for_generation(self, *args: Any, tags: Any = None, **kwargs: Any) -> bool:
        """Ready for a generation phase: wake every colocated worker (``tags``: ``weights``
        before a refit, ``kv_cache`` after it, as NeMo-RL's colocated loop asks; none: both)
        and, once all is back, wait until each serves. False when one cannot serve yet (its
        level-2 sleep dropped its weights: a refit must load them first)."""
        self._check_open()
        return self._on_survivors(lambda: self._colocated.wake(tags))

    def finish_generation(self, *args: Any, release_gpu: bool = True, **kwargs: Any) -> bool:
        """The end of a generation phase: no rollout may be served from stale cache after it,
        and the colocated workers sleep (``release_gpu=False``: the phase is over but the
        trainer does not need the devices, so they stay awake), as NeMo-RL's loop asks."""
        self.invalidate_kv_cache()
        if release_gpu:
            self._on_survivors(self._colocated.sleep)
        return True

    def sleep_states(self) -> dict[str, SleepState]:
        """Each colocated worker's sleep state."""
        self._check_open()
        return self._on_survivors(self._colocated.states)

    # -- refit --------------------------------------------------------------------------------
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list:
        """Every worker joins the refit group at ``ip:port`` (rank ``T + i * E``); returns one
        future per worker at once, so the trainer can join while they wait (Ray ObjectRefs when
        Ray runs in the driver, else concurrent futures). The world size is checked first."""
        self._check_open()
        self._members.forget_lost()
        return self._fleet_refit.init_collective(ip, port, world_size,
                                                 train_world_size=train_world_size)

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any]) -> Any:
        """NeMo-RL's ``{name: (shape, dtype)}``; every worker refuses unknown names, wrong shapes
        or dtypes before any transfer. Returns the RefitInfo (its order is the wire order)."""
        self._check_open()
        return self._on_survivors(lambda: self._fleet_refit.prepare_refit_info(state_dict_info))

    def update_weights_from_collective(self, refit_timeout_s: float | None = None, *,
                                       mode: str | None = None) -> list:
        """Every worker receives and loads the trainer's broadcast; one future per worker. Past
        ``refit_timeout_s`` each worker abandons it and keeps its weights (the futures fail
        naming the deadline). ``mode``: ``drain`` (default), ``keep``, ``recompute``
        (docs/async-rl.md). With ``max_staleness``, this first waits for the bound (call it
        from the trainer's thread, not from a loop that runs ``generate_async``)."""
        self._check_open()
        return self._on_survivors(
            lambda: self._fleet_refit.update_weights_from_collective(mode, refit_timeout_s))

    def reload_weights(self, weights_path: str, *, mode: str | None = None,
                       refit_timeout_s: float | None = None) -> dict[str, int]:
        """A refit from a checkpoint folder that every worker can read (NeMo-RL's disk refit):
        each checks it, then loads it with its engine's own loader, in ``mode`` (``keep`` by
        default: rollouts in flight freeze, then go on); blocks until all did and returns
        each worker's version. A folder any worker refuses changes none (WorkerFailures names
        each). Past ``refit_timeout_s`` each worker abandons it."""
        self._check_open()
        return self._on_survivors(
            lambda: self._fleet_refit.reload_weights(weights_path, mode, refit_timeout_s))

    def get_refit_payload_mode(self) -> str:
        return "hf_export"  # the workers check and load Hugging Face names (prepare_refit_info)

    def pause_generation_for_refit(self, *, clear_cache: bool) -> bool:
        """Hold new rollouts at the driver (none fails: hold.py); drop caches if asked."""
        return self._hold.pause(clear_cache=clear_cache)

    def resume_generation_after_refit(self) -> bool:
        """Let held rollouts go on after a refit."""
        return self._hold.resume()

    def pause_generation(self, mode: str) -> None:
        """Hold new rollouts as NeMo-RL's ``mode`` says."""
        self._hold.pause_in_mode(mode)

    def continue_generation(self) -> None:
        """Let held rollouts go on."""
        self._hold.resume()

    def get_weight_versions(self) -> dict[str, int]:
        """Worker id -> the version of the weights it serves (0 = as started, +1 per refit;
        a worker that joined takes the fleet's version at its first refit)."""
        self._check_open()
        return self._on_survivors(self._fleet_refit.weight_versions)

    def update_weights_via_ipc_zmq(self, *, mode: str | None = None) -> list:
        """NeMo-RL's colocated refit (core/ipc_stream.py): a future per worker, True once done."""
        self._check_open()
        return self._on_survivors(lambda: self._fleet_refit.update_weights_via_ipc_zmq(mode))

    # -- pickling -----------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "frontend_url": self.frontend_url,
                "transport": self._transport, "controls": self._members.controls}

    def __setstate__(self, state: dict[str, Any]) -> None:
        FleetGeneration.__init__(self, state["config"], frontend_url=state["frontend_url"],
                                 transport=state["transport"], controls=state["controls"])
        self.is_copy = True

    def __repr__(self) -> str:
        kind = "copy" if self.is_copy else "owner"
        return f"FleetGeneration({self.frontend_url!r}, workers={list(self.worker_ids)}, {kind})"

