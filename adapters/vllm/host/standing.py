"""The served weights' standing, as the engine's parts change it: their version, the cache salt
new rollouts get, whether they are whole, and whether they may serve at all. Each piece is
owned here and changed only through these methods: the refit commits (``WeightsStanding.commit``)
or tears them, the colocated refit the same, sleep drops the cache (and keeps its own state in
the ``SleepTracker`` the standing reads); serving asks ``check_serving``, once per rollout."""

from __future__ import annotations

from typing import Any

from rollout_fleet.adapters.shared.errors import first_line
from rollout_fleet.adapters.vllm.messages import REFIT_STATS_RPC, RefitStats
from rollout_fleet.core.errors import EngineError
from rollout_fleet.core.refit import DEFAULT_REFIT_MODE, RefitMode, next_version
from rollout_fleet.core.sleep import SleepTracker


class WeightsHealth:
    """Whether the weights are whole: a refit that died half way leaves them torn (some layers
    new, some old), and the engine refuses rollouts until a refit succeeds."""

    def __init__(self) -> None:
        self._torn: str | None = None

    @property
    def torn(self) -> str | None:
        """Why the weights are torn; None while they are whole."""
        return self._torn

    def mark_torn(self, reason: str) -> None:
        self._torn = reason

    def mark_whole(self) -> None:
        self._torn = None

    def check_serving(self) -> None:
        if self._torn:
            raise EngineError(f"this worker's weights are torn ({self._torn}); it serves again"
                              " after a refit succeeds")


class CacheSalt:
    """The salt new rollouts' prefixes are cached under: none while every cached block was
    computed by the weights serving; a fresh one after a keep-mode refit left blocks of older
    weights in use, so that no new rollout reuses them."""

    def __init__(self) -> None:
        self._salt: str | None = None

    @property
    def value(self) -> str | None:
        return self._salt

    def clear(self) -> None:
        """Nothing cached is left from older weights."""
        self._salt = None

    def set_apart(self, version: int) -> None:
        """Older weights' blocks are still cached: new rollouts cache apart from them."""
        self._salt = f"rollout-fleet-weights-v{version}"


class WeightsStanding:
    """The weights' version, health and cache salt, and the steps that change them together;
    ``sleep`` is the engine's sleep state, which says whether the weights are there to serve.
    The engine labels every token with the version it is told (``label``), where its vLLM
    takes one (``labels_tokens``, found as the engine starts); an older vLLM has none, and
    this count alone is the version (features.py)."""

    def __init__(self, sleep: SleepTracker) -> None:
        self.health = WeightsHealth()
        self.salt = CacheSalt()
        self._version = 0
        self._sleep = sleep
        self._labels_tokens = False

    @property
    def version(self) -> int:
        return self._version

    def labels_tokens(self, per_engine_versions: bool) -> None:
        """Whether the engine takes the version to label tokens with (found as it starts)."""
        self._labels_tokens = per_engine_versions

    async def label(self, engine: Any) -> None:
        """Tell ``engine`` the version to label tokens with from now on."""
        if self._labels_tokens:
            await engine.update_weight_version(str(self._version))

    def check_serving(self) -> None:
        """Refuse a rollout while asleep or woken without weights (``EngineAsleep``) or torn by
        a refit that died half way. The tracker's ``serving`` field first: a serving engine
        pays one look at it."""
        if not self._sleep.serving:
            self._sleep.check_serving()
        self.health.check_serving()

    def check_refit_allowed(self) -> None:
        """A refit needs the weights' memory back (``wake_up(tags=["weights"])`` first)."""
        if not self._sleep.serving:
            self._sleep.check_refit_allowed()

    async def commit(self, engine: Any, mode: RefitMode = DEFAULT_REFIT_MODE,
                     version: int | None = None) -> int:
        """New weights are loaded (the engine still paused): whole again (weights a level-2
        sleep dropped are back), the cache dropped as ``mode`` says, and every token from now
        on labelled with the new version."""
        self.health.mark_whole()
        if not self._sleep.serving:
            self._sleep.refit_loaded()
        if mode == RefitMode.KEEP:
            await self.keep_running_kv(engine)
        else:  # drained: nothing runs; recompute: running rollouts are preempted and recompute
            await self.reset_cache(engine)
        self._version = next_version(self._version, version)
        await self.label(engine)
        return self._version

    async def reset_cache(self, engine: Any) -> None:
        if await engine.reset_prefix_cache():
            self.salt.clear()
            return
        # Running requests still hold blocks: preempt them (they recompute), then reset.
        if not await engine.reset_prefix_cache(reset_running_requests=True):
            raise EngineError("vLLM refused to reset its prefix cache")
        self.salt.clear()

    async def keep_running_kv(self, engine: Any) -> None:
        """Keep mode: the rollouts in flight keep the KV they hold. vLLM resets its prefix cache
        only when no block is in use; when some are, new rollouts get a cache salt of the new
        version instead, so none of them reuses a block computed by older weights."""
        if await engine.reset_prefix_cache():
            self.salt.clear()
        else:
            self.salt.set_apart(self._version + 1)

    async def note_failed_refit(self, engine: Any) -> None:
        """Ask every engine rank how its failed refit ended: rolled back, or torn."""
        try:
            ranks = [RefitStats.from_wire(rank)
                     for rank in await engine.collective_rpc(REFIT_STATS_RPC)]
        except Exception as error:  # the engine is in trouble; refuse rollouts to be safe
            self.health.mark_torn(f"its refit state is unknown: {first_line(error)}")
            return
        if any(rank.torn for rank in ranks):
            self.health.mark_torn("a refit failed half way and no copy of the previous weights"
                                  " was kept")
