"""A recorded load, replayed: the copies a model's ``load_weights`` made from the trainer's
kept buffers into its parameters, made again at the next refit without the loader.

An in-place colocated refit hands the engine the same tensors at the same places of the same
buffers every time (the trainer's parameters, which an in-place optimizer step does not move).
The loader's work per tensor (a view per tensor, name lookups, the fused-layer bookkeeping) is
then the same every time too, and for a model with hundreds of tensors it costs several
milliseconds: more than the copy itself for a 1B model on one GPU. So the first such refit runs
the loader under a recorder (``torch.utils._python_dispatch.TorchDispatchMode``) and keeps what
it did when that was nothing but copies from the buffers straight into parameter storage; the
later ones make those copies again, in the same order, one ``copy_`` each.

The recording is kept only when it is safe to replay, and it is dropped (the loader runs again)
when anything it relied on changes:
- every operation of the load was a view, a copy from a buffer into a parameter's storage, a
  constant written into a parameter (``fill_``: vLLM zeroes the padding rows of a vocabulary),
  or the opening of a view into a buffer; anything else (a cast, a clone, arithmetic: a loader that
  processes what it loads, vLLM's layerwise reload that loads into fresh tensors first) makes
  the load not replayable, and it is recorded why;
- the copies read every loaded byte once (a loader that reads part of a tensor, as tensor
  parallelism does, is not replayed);
- at replay: the same refit info, tensors skipped and bucket layout; the same buffers, kept open
  (not reopened); every parameter still at the address it had (none rebound).
A recorded copy keeps its destination, a view of a parameter's storage; its source is kept as
a place in a buffer (slot, dtype, shape, strides, offset), so no view into the trainer's memory
outlives the refit that made it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_COPY = torch.ops.aten.copy_.default
_FILL = torch.ops.aten.fill_.Scalar
# OpenedBuffer makes its views into a buffer with set_ on an empty tensor
_VIEW_MAKING = ("aten::set_", "aten::empty")


@attrs.frozen
class SourcePlace:
    """Where a recorded copy read: a typed strided view of buffer ``slot``."""

    slot: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of ``dtype`` from the storage's start

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.size:
            count *= d
        return count * self.dtype.itemsize


@attrs.frozen
class RecordedCopy:
    destination: torch.Tensor  # a view of a parameter's storage
    source: SourcePlace
    non_blocking: bool


@attrs.frozen
class RecordedFill:
    """A constant the loader wrote into a parameter (vLLM zeroes a padded vocabulary's rows)."""

    destination: torch.Tensor
    value: Any


class LoadRecorder(TorchDispatchMode):
    """Records a load's writes, copies from the buffers' storages (``sources``: storage address
    -> slot) into the parameters' (``parameters``: storage addresses) and constants written
    into parameters; ``refusal`` names the first operation that makes the load not replayable."""

    def __init__(self, sources: dict[int, int], parameters: frozenset[int]) -> None:
        super().__init__()
        self.sources, self.parameters = sources, parameters
        self.writes: list[RecordedCopy | RecordedFill] = []  # in the loader's order
        self.refusal: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.refusal is None:
            self._note(func, args, kwargs)
        return result

    def _note(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = func.name()
        if func is _COPY:
            self._note_copy(args[0], args[1], bool(args[2] if len(args) > 2
                                                  else kwargs.get("non_blocking", False)))
        elif func is _FILL and _storage_address(args[0]) in self.parameters:
            self.writes.append(RecordedFill(args[0], args[1]))
        elif func.is_view or name.startswith(_VIEW_MAKING):
            return
        else:
            self.refusal = f"the load ran {name}, not only copies into the parameters"

    def _note_copy(self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        slot = self.sources.get(_storage_address(source))
        if slot is None:
            self.refusal = "the load copied something that is not in the trainer's buffers"
        elif _storage_address(destination) not in self.parameters:
            self.refusal = "the load copied out of a buffer into a tensor that is no parameter"
        else:
            self.writes.append(RecordedCopy(destination, SourcePlace(
                slot, source.dtype, tuple(source.shape), tuple(source.stride()),
                source.storage_offset()), non_blocking))


@attrs.frozen
class LoadReplay:
    """A refit's recorded writes, and what must be unchanged for them to stand for its load."""

    key: Any  # the refit info, the skipped names and the buckets' layout and slots
    buffers: tuple[tuple[int, Any], ...]  # (slot, the opened buffer recorded from)
    parameter_addresses: tuple[int, ...]
    writes: tuple[RecordedCopy | RecordedFill, ...]  # in the loader's order

    def matches(self, key: Any, kept: dict[int, tuple[Any, Any]], model: Any) -> bool:
        if key != self.key:
            return False
        for slot, opened in self.buffers:
            held = kept.get(slot)
            if held is None or held[1] is not opened:
                return False
        return parameter_addresses(model) == self.parameter_addresses

    @functools.cached_property
    def _typed_sources(self) -> tuple[tuple[int, Any, torch.dtype], ...]:
        """(slot, opened buffer, dtype) for each typed view of a buffer the copies read."""
        opened = dict(self.buffers)
        wanted = sorted({(c.source.slot, str(c.source.dtype)): c.source.dtype
                         for c in self.writes if isinstance(c, RecordedCopy)}.items())
        return tuple((slot, opened[slot], dtype) for (slot, _), dtype in wanted)

    def replay(self) -> int:
        """Make every recorded copy and fill again, in order; their count."""
        typed = {(slot, dtype): _typed(opened.block, dtype)
                 for slot, opened, dtype in self._typed_sources}
        for write in self.writes:
            if isinstance(write, RecordedFill):
                write.destination.fill_(write.value)
                continue
            place = write.source
            source = typed[place.slot, place.dtype].as_strided(place.size, place.stride, place.offset)
            write.destination.copy_(source, non_blocking=write.non_blocking)
        return len(self.writes)


def recorder_for(model: Any, buffers: Iterable[tuple[int, Any]]) -> LoadRecorder:
    """A recorder of copies out of ``buffers`` ((slot, opened buffer)) into ``model``."""
    sources = {_storage_address(opened.block): slot for slot, opened in buffers}
    return LoadRecorder(sources, frozenset(_storage_address(t) for t in _model_tensors(model)))


def replay_of(key: Any, buffers: Sequence[tuple[int, Any]], model: Any,
              recorded: Sequence[RecordedCopy | RecordedFill], loaded_bytes: int) -> "LoadReplay | str":
    """The replay of a load whose every recorder came back clean, or why it is none."""
    read = sum(copy.source.nbytes for copy in recorded if isinstance(copy, RecordedCopy))
    if read != loaded_bytes:
        return f"the load read {read} bytes of the buffers for {loaded_bytes} loaded"
    return LoadReplay(key, tuple(buffers), parameter_addresses(model), tuple(recorded))


def parameter_addresses(model: Any) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in _model_tensors(model))


def _model_tensors(model: Any) -> list[torch.Tensor]:
    """The model's parameters and buffers (a module's own; else its ``state_dict``'s tensors):
    a copy into anything else is not a load into the model."""
    if isinstance(model, torch.nn.Module):
        found = [*model.parameters(), *model.buffers()]
        if found:
            return found
    state_dict = getattr(model, "state_dict", None)
    if state_dict is None:
        return []
    return [t for t in state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]


def _storage_address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _typed(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole of a buffer's storage as ``dtype`` elements (``as_strided`` offsets are in
    elements from the storage's start, as the recorded ones are)."""
    view = torch.empty((0,), dtype=dtype, device=block.device)
    return view.set_(block.untyped_storage(), 0, (block.untyped_storage().nbytes() // dtype.itemsize,))
