"""The project's packed refit protocol as a vLLM weight-transfer engine, run inside vLLM's worker.

vLLM builds one weight-transfer engine per engine rank (``WeightTransferEngineFactory``, keyed by
``WeightTransferConfig.backend``) and drives it with init -> start -> update -> finish. This one
joins the refit group at ``first_rank + engine rank``, receives the packed buckets over gloo (CPU)
or NCCL (GPU) with the collective adapter's receiver, and hands each tensor to the model's
``load_weights`` as it arrives: vLLM's layerwise reload copies a layer into the live parameters
once all its tensors are in, and loading overlaps the transfer. The same code runs on both backends.

Memory beyond the model's own parameters, during a refit: the receiver's ``num_buffers`` blocks
of the plan's largest bucket (a tensor is a view of its block; each is dropped once loaded, so
the block is reused), plus what vLLM's layerwise reload holds for the layer being loaded: the
received parts of a fused layer (q, k and v; gate and up) until its last part arrives (a block
they view stays alive until then), and the layer materialized afresh in checkpoint format (its
parameters' bytes) while it is loaded, processed (on the CPU: its kernels repacked while the old
packed copy still serves) and copied into the live parameters. Nothing else is kept;
``receive_memory`` reports the receive bytes alive and their peak (bench/bench_refit_memory.py
measures the whole). On the CPU the memory the reload frees is handed back with ``malloc_trim``.

A transfer can die half way (a trainer gone, a timeout): some layers then hold new weights and
some old. ``rollback="last_good"`` restores the last complete set (the previous refit's received
tensors, kept; before the first refit, the model folder's checkpoint), so the worker keeps
serving consistent weights; ``"none"`` keeps no copy and reports the weights as torn (the worker
then refuses rollouts until a refit succeeds). CPU engines default to the first, GPU engines to
the second (a second model-sized copy in GPU memory is what a GPU fleet cannot spare).

Across vLLM versions (features detected, not versions): vLLM 0.25's base class also declares
an abstract ``trainer_send_weights`` (the trainer's side, which the project's trainers do with
the collective adapter's sender): ``compose_transfer_engine`` gives it one that says so, and
names any other abstract method the base may add instead of letting vLLM fail to instantiate the
engine. Layerwise reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``) is
used when vLLM has it, except for an unquantized model on a GPU; there, and without it, the
model's ``load_weights`` copies each tensor into the live parameters directly (``InPlaceReload``),
which is right for unquantized checkpoints, whose loaded tensors need no processing after loading
on a GPU (on the CPU vLLM repacks its kernels' weights after loading: layerwise reload there).

vLLM is imported lazily: the class runs without it (built with no vLLM config, over a plain
torch model, it loads in place with ``InPlaceReload``), which is how bench/bench_gpu_refit.py
proves this very receiver on GPUs where vLLM is not installed. The composition root registers it
with vLLM under ``BACKEND_NAME`` and sets ``join_receiver``.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from rollout_fleet.adapters.vllm.inside.transfer_support import (
    Progress,
    counting,
    cuda_memory_end,
    cuda_memory_start,
    host_trimmer,
    synchronize,
)
from rollout_fleet.adapters.vllm.messages import (
    BACKEND_NAME, PackedInitInfo, PackedUpdateInfo, RefitInfoOnce, RefitStats,
)
from rollout_fleet.core.errors import RefitError
from rollout_fleet.core.refit import GroupJoin, RefitInfo, RefitRollback
from rollout_fleet.ports.collective import ReceivingEnd, WeightReceiver

log = logging.getLogger(__name__)

class LayerwiseReload:
    """vLLM's in-place reload: layers are rebuilt and re-processed as their tensors arrive."""

    def begin(self, model: Any) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(model)

    def end(self, model: Any, model_config: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(model, model_config)


def reload_strategy(model_config: Any = None, device: Any = None) -> "LayerwiseReload | InPlaceReload":
    """Loading in place for an unquantized model on a GPU (its loaders copy each tensor into
    its parameter, and nothing is processed after loading there: one copy, no parameter
    rebound); else vLLM's layerwise reload where this vLLM has it, else in place (logged)."""
    if getattr(device, "type", None) == "cuda" and model_config is not None \
            and getattr(model_config, "quantization", "unknown") is None:
        log.info("an unquantized model on a GPU: refits load each tensor into its parameter")
        return InPlaceReload()
    try:
        from vllm.model_executor.model_loader.reload import (  # noqa: F401
            finalize_layerwise_reload, initialize_layerwise_reload,
        )
    except ImportError:
        log.warning("this vLLM has no layerwise reload: refits load each tensor in place"
                    " (right for unquantized checkpoints)")
        return InPlaceReload()
    return LayerwiseReload()


class InPlaceReload:
    """A plain torch model whose ``load_weights`` copies each tensor into its parameter."""

    def begin(self, model: Any) -> None:
        pass

    def end(self, model: Any, model_config: Any) -> None:
        pass


R = TypeVar("R", bound=ReceivingEnd)


class TransferEngine(Generic[R]):
    """A weight-transfer engine with vLLM's interface (init / start / update / finish) over a
    receiver of the refit group (``R``): what the packed and sharded engines share."""

    init_info_cls = PackedInitInfo
    update_info_cls = PackedUpdateInfo
    supports_draft_weight_update = False
    defers_processing = False
    # (join, engine rank) -> a receiver in the group; set by the composition root.
    join_receiver: Callable[[GroupJoin, int], R] | None = None

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.model_config = getattr(vllm_config, "model_config", None)
        self.parallel_config = getattr(vllm_config, "parallel_config", None)
        self.device = device
        self.model = model
        self.reload: LayerwiseReload | InPlaceReload = reload_strategy(
            self.model_config, torch_device(device)) if vllm_config is not None else InPlaceReload()
        self.engine_rank = _engine_rank(self.parallel_config)
        self.receiver: R | None = None
        self.rollback = RefitRollback.NONE
        self.stats = RefitStats()
        self._infos = RefitInfoOnce()  # the last refit's info: a refit carries it on change
        self._last_good: list[tuple[str, Any]] | None = None  # the previous refit's tensors
        self._updating = False

    # -- vLLM's interface ---------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> PackedInitInfo:
        return PackedInitInfo.from_wire(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> PackedUpdateInfo:
        return PackedUpdateInfo.from_wire(update_dict)

    def init_transfer_engine(self, init_info: PackedInitInfo) -> None:
        """Join the refit group (blocks until every rank came, bounded by the join's timeout)."""
        if self.join_receiver is None:
            raise RefitError(f"{type(self).__name__}.join_receiver is not set: register the engine"
                             " through the composition root")
        self.shutdown()
        self._infos.forget()  # a new group: its first refit carries its info
        self.rollback = init_info.rollback
        self.receiver = self.join_receiver(init_info.group_join, self.engine_rank)
        if self.rollback is RefitRollback.LAST_GOOD:
            self.receiver.hold_previous = True  # the kept set stays warm beside the next one

    def start_weight_update(self) -> None:
        self.reload.begin(self.model)
        self._updating = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        synchronize(self.device)

    def receive_weights(self, update_info: PackedUpdateInfo) -> None:
        """Receive every bucket and load each tensor as it comes; on failure, end the reload
        and restore the last complete weights (or report them torn), then raise."""
        receiver = self.joined()
        started = time.perf_counter()
        # Only the rollback copy keeps the received tensors; otherwise each is dropped once
        # loaded, so its block goes back to the receiver (see receive_memory).
        kept: list[tuple[str, Any]] | None = [] if self.rollback is RefitRollback.LAST_GOOD else None
        progress = Progress(trim=host_trimmer(self.device), trim_every=receiver.spec.buffer_bytes)
        memory_before = cuda_memory_start(self.device)
        skip = frozenset(update_info.skip)
        try:
            info = self._infos.incoming(update_info.info)
            self.model.load_weights(item for item in counting(
                self.stream(receiver, info), progress, kept) if item[0] not in skip)
            if progress.tensors != len(info.tensors):
                raise RefitError(f"the model's load_weights stopped after {progress.tensors} of"
                                 f" {len(info.tensors)} tensors")
        except BaseException as error:
            self._infos.forget()  # a failed refit: the next one carries its info again
            self.recover(error, loaded=progress.tensors)
            raise
        before, peak, after = cuda_memory_end(self.device, memory_before)
        self.stats = RefitStats(progress.tensors, info.total_bytes, time.perf_counter() - started,
                                progress.waiting_s, cuda_before=before, cuda_peak=peak,
                                cuda_after=after)
        log.info("refit received and loaded: %d tensors, %.0f MiB in %.3f s (%.3f s of it waiting"
                 " for the wire)", self.stats.tensors, self.stats.nbytes / 2**20,
                 self.stats.seconds, self.stats.waiting_s)
        if kept is not None:
            self._last_good = [item for item in kept if item[0] not in skip]

    def stream(self, receiver: R, info: RefitInfo) -> Iterator[tuple[str, Any]]:
        """(name, tensor) pairs for the model's ``load_weights``, in refit order."""
        raise NotImplementedError

    def joined(self) -> R:
        if self.receiver is None:
            raise RefitError("update_weights before init_transfer_engine")
        return self.receiver

    def receive_memory(self) -> dict[str, int]:
        """Receive bytes alive now and at most since the last call, the bound for the last
        refit's plan, and the rollback copy's bytes (counted apart: it is the model's size)."""
        account = self.receiver.account if self.receiver is not None else None
        if account is None:
            return {}
        memory = {"live_bytes": account.live_bytes, "peak_bytes": account.peak_bytes,
                  "last_good_bytes": sum(t.numel() * t.element_size()
                                         for _, t in self._last_good or ())}
        account.reset_peak()
        return memory

    def forget_last_good(self) -> None:
        """The weights were replaced another way (vLLM's reload from a folder): the copy kept
        is older than them, so a failed refit restores the model folder's instead."""
        self._last_good = None

    def finish_weight_update(self) -> None:
        if self._updating:
            self._updating = False
            self.reload.end(self.model, self.model_config)
            trim = host_trimmer(self.device)
            if trim is not None:
                trim()

    def shutdown(self) -> None:
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """vLLM's trainer-side hook (abstract in some versions): the project's trainers send
        with the collective adapter's sender (``Fleet.refit``), never through this class."""
        raise RefitError(f"{BACKEND_NAME}: trainers send with rollout_fleet's collective sender"
                         " (Fleet.refit / the refit port), not through vLLM's trainer_send_weights")

    # vLLM retargets engines at a draft model; this one serves the main model only.
    def set_weight_update_target(self, model: Any, model_config: Any) -> None:
        raise RefitError(f"{BACKEND_NAME} does not update draft models")

    def reset_weight_update_target(self) -> None:
        pass

    def drain_pending(self) -> None:
        pass

    # -- failure (hooks its subclasses call and extend) -----------------------------------
    def recover(self, error: BaseException, *, loaded: int) -> None:
        self.finish_weight_update()  # leave the reload: every layer back on its kernel tensors
        if loaded == 0:  # failed before the first tensor (a header mismatch): nothing changed
            self.stats = RefitStats()
            return
        if self.rollback is RefitRollback.NONE:
            self.stats = RefitStats(torn=True)
            log.error("refit failed after %d tensors (%s); the weights are torn until a refit"
                      " succeeds", loaded, error)
            return
        try:
            source = self._last_good if self._last_good is not None else self.checkpoint_weights()
            self.start_weight_update()
            self.model.load_weights(iter(source))
            self.finish_weight_update()
        except BaseException as rollback_error:
            self.stats = RefitStats(torn=True)
            log.error("refit failed (%s) and so did the rollback (%s)", error, rollback_error)
            return
        self.stats = RefitStats(rolled_back=True)
        log.warning("refit failed after %d tensors (%s); the last complete weights are back",
                    loaded, error)

    def checkpoint_weights(self) -> list[tuple[str, Any]]:
        """The weights the engine started with, read from its model folder."""
        from safetensors.torch import load_file

        if self.model_config is None:
            raise RefitError("cannot roll back: this engine was built without a model folder")
        folder = Path(self.model_config.model)
        tensors: list[tuple[str, Any]] = []
        for path in sorted(folder.glob("*.safetensors")):
            tensors += load_file(str(path)).items()
        if not tensors:
            raise RefitError(f"cannot roll back: no *.safetensors in {folder}")
        return tensors


class PackedTransferEngine(TransferEngine[WeightReceiver]):
    """The packed protocol's engine: every tensor whole, as the receiver unpacks it."""

    def stream(self, receiver: WeightReceiver, info: RefitInfo) -> Iterator[tuple[str, Any]]:
        return receiver.receive(info)


def compose_transfer_engine(base: type, join_receiver: Callable[[GroupJoin, int], Any],
                            module: str = __name__, name: str = "RolloutFleetTransferEngine",
                            engine: type | None = None) -> type:
    """``engine`` (default ``PackedTransferEngine``) on top of vLLM's base class (``base``)
    with its receiver set.
    An abstract method of ``base`` that the project does not implement is named here (a
    TypeError at composition) rather than as vLLM's "Can't instantiate abstract class" inside
    its engine core."""
    cls = types.new_class(name, (engine or PackedTransferEngine, base), exec_body=lambda ns: ns.update(
        join_receiver=staticmethod(join_receiver), __module__=module))
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise TypeError(f"{name}: vLLM's {base.__qualname__} declares abstract methods the"
                        f" project's refit engine lacks: {', '.join(missing)}")
    return cls


def torch_device(device: Any) -> Any:
    """vLLM hands the engine its device as a ``torch.device`` (or its spelling)."""
    if device is None or hasattr(device, "type"):
        return device
    import torch

    return torch.device(device)


def _engine_rank(parallel_config: Any) -> int:
    """This worker's rank among its engine's ranks (tensor x pipeline; data-parallel replicas
    after each other), as vLLM numbers them."""
    if parallel_config is None:
        return 0
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank
