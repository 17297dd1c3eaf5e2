"""Whether a checkpoint folder can replace an engine's weights whole, decided before anything
is paused: the folder as an adapter read it (its entries, each safetensors file's size and
header, the index) against the engine's parameters. Pure: the adapter reads the files.

Refused, each by name: a staging folder (``.tmp``) or a file still being written; an index
naming a file the folder lacks, or a tensor its file lacks; a file shorter than its header
says (truncated) or not made of its tensors exactly; a tensor repeated, unknown to the engine,
of another shape, or of a dtype the loader cannot cast to the parameter's; a parameter missing
(a loader keeps the old values of a missing one: old and new weights mixed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
from rollout_fleet.core.errors import IncompleteCheckpoint, WeightMismatch
from rollout_fleet.core.refit import DTYPE_BYTES, TensorMeta

STAGING_SUFFIXES = (".tmp", ".partial", ".part", ".incomplete")  # written, not yet renamed
INDEX_NAME = "model.safetensors.index.json"  # the Hugging Face name a loader looks for
# A loader copies a stored tensor into its parameter, casting between these.
CAST_FLOATS = frozenset({"float32", "float16", "bfloat16"})
SAFETENSORS_PREFIX = 8  # the header's length, a little-endian u64, comes first


@attrs.frozen
class StoredTensor:
    """One tensor as a safetensors header describes it: ``dtype`` a core dtype name (or the
    file's own, for one the core does not know), bytes ``begin``..``end`` of the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    def expected_bytes(self) -> int | None:
        if self.dtype not in DTYPE_BYTES:
            return None
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPE_BYTES[self.dtype]


@attrs.frozen
class SafetensorsFile:
    name: str  # within the folder
    size: int  # bytes on disk
    header_bytes: int
    tensors: tuple[StoredTensor, ...]

    @property
    def data_bytes(self) -> int:
        return self.size - SAFETENSORS_PREFIX - self.header_bytes


@attrs.frozen
class CheckpointListing:
    """A checkpoint folder as read: every entry's name, every ``*.safetensors`` file, and the
    index's weight map (tensor -> file) when the folder has one."""

    folder: str
    entries: tuple[str, ...]
    files: tuple[SafetensorsFile, ...]
    index: Mapping[str, str] | None = None


@attrs.frozen
class CheckpointSummary:
    """What a checked folder holds: the files a loader reads, the tensors and their bytes, and
    the tensors stored at another float dtype than their parameter's (the loader casts them)."""

    folder: str
    files: tuple[str, ...]
    tensors: int
    nbytes: int
    cast: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, object]:
        return {"folder": self.folder, "files": list(self.files), "tensors": self.tensors,
                "bytes": self.nbytes, "cast": list(self.cast)}


def check_checkpoint(listing: CheckpointListing, metas: Mapping[str, TensorMeta],
                     optional: Mapping[str, TensorMeta] | None = None) -> CheckpointSummary:
    """``listing`` holds every one of ``metas`` (name, shape, a dtype castable to the
    parameter's), whole, and nothing else but ``optional`` names (a loader skips them: a
    tied ``lm_head.weight``). Raises ``IncompleteCheckpoint`` or ``WeightMismatch`` naming the
    file and the tensor at fault."""
    check_finished(listing)
    files = loaded_files(listing)
    for file in files:
        check_file_whole(listing.folder, file)
    stored = stored_tensors(files)
    check_index(listing, files)
    known = {**(optional or {}), **metas}
    cast = [check_tensor(tensor, file, known) for tensor, file in stored.values()]
    missing = sorted(set(metas) - set(stored))
    if missing:
        raise WeightMismatch("tensor names", missing[:5], f"{len(missing)} of the engine's"
                             f" parameters are missing from {listing.folder}: a reload"
                             " carries every one")
    return CheckpointSummary(listing.folder, tuple(f.name for f in files), len(stored),
                             sum(f.data_bytes for f in files),
                             tuple(sorted(name for name in cast if name)))


def check_finished(listing: CheckpointListing) -> None:
    """No staging folder, and no file in it still being written."""
    folder = listing.folder.rstrip("/")
    if folder.endswith(STAGING_SUFFIXES):
        raise IncompleteCheckpoint("checkpoint", listing.folder, "is a staging folder (its name"
                                   " ends in .tmp or the like): an export still being written;"
                                   " load the folder it is renamed to once complete")
    for entry in listing.entries:
        if entry.endswith(STAGING_SUFFIXES):
            raise IncompleteCheckpoint("checkpoint file", f"{listing.folder}/{entry}",
                                       "is still being written (a staging name)")


def loaded_files(listing: CheckpointListing) -> list[SafetensorsFile]:
    """The files a loader reads: those the index names, else every ``*.safetensors``."""
    by_name = {f.name: f for f in listing.files}
    if listing.index is None:
        files = sorted(by_name.values(), key=lambda f: f.name)
    else:
        named = sorted(set(listing.index.values()))
        absent = [name for name in named if name not in by_name]
        if absent:
            raise IncompleteCheckpoint("checkpoint file", f"{listing.folder}/{absent[0]}",
                                       f"is named by {INDEX_NAME} but the folder lacks it"
                                       f" ({len(absent)} file(s) missing)")
        files = [by_name[name] for name in named]
    if not files:
        raise IncompleteCheckpoint("checkpoint", listing.folder, "holds no *.safetensors file")
    return files


def check_file_whole(folder: str, file: SafetensorsFile) -> None:
    """The data section is exactly the tensors the header lists, each of its own size."""
    where = f"{folder}/{file.name}"
    if file.data_bytes < 0:
        raise IncompleteCheckpoint("checkpoint file", where, f"is truncated: {file.size} bytes,"
                                   f" shorter than its {file.header_bytes}-byte header")
    end = max((t.end for t in file.tensors), default=0)
    if end > file.data_bytes:
        cut = next(t.name for t in sorted(file.tensors, key=lambda t: t.end)
                   if t.end > file.data_bytes)
        raise IncompleteCheckpoint("checkpoint file", where, f"is truncated: its header describes"
                                   f" {end} bytes of tensor data, the file holds"
                                   f" {file.data_bytes} (tensor {cut!r} is cut)")
    for tensor in file.tensors:
        expected = tensor.expected_bytes()
        if tensor.begin < 0 or tensor.end < tensor.begin or (
                expected is not None and tensor.end - tensor.begin != expected):
            raise IncompleteCheckpoint("checkpoint file", where, f"tensor {tensor.name!r} spans"
                                       f" bytes {tensor.begin}..{tensor.end}, not the"
                                       f" {expected} its shape and dtype take: a corrupt header")
    if sum(t.end - t.begin for t in file.tensors) != file.data_bytes:
        raise IncompleteCheckpoint("checkpoint file", where, f"holds {file.data_bytes} bytes of"
                                   " data, not the sum of its tensors': a corrupt file")


def stored_tensors(files: Iterable[SafetensorsFile]) -> dict[str, tuple[StoredTensor, str]]:
    """Tensor name -> (the tensor, its file); a name in two files is refused."""
    stored: dict[str, tuple[StoredTensor, str]] = {}
    for file in files:
        for tensor in file.tensors:
            if tensor.name in stored:
                raise IncompleteCheckpoint("tensor", tensor.name, f"is stored twice: in"
                                           f" {stored[tensor.name][1]} and {file.name}")
            stored[tensor.name] = (tensor, file.name)
    return stored


def check_index(listing: CheckpointListing, files: Iterable[SafetensorsFile]) -> None:
    """Every tensor the index places in a file is in that file's header."""
    if listing.index is None:
        return
    held = {f.name: {t.name for t in f.tensors} for f in files}
    for name, file in sorted(listing.index.items()):
        if name not in held[file]:
            raise IncompleteCheckpoint("tensor", name, f"{INDEX_NAME} places it in {file},"
                                       " whose header lacks it: an incomplete export")


def check_tensor(tensor: StoredTensor, file: str, known: Mapping[str, TensorMeta]) -> str:
    """Refuse a tensor the engine has no parameter for, or of another shape or an uncastable
    dtype; its name when the loader will cast it, else ''."""
    meta = known.get(tensor.name)
    if meta is None:
        raise WeightMismatch("tensor name", tensor.name, f"in {file}: the engine has no"
                             " parameter of that name")
    if tuple(tensor.shape) != meta.shape:
        raise WeightMismatch(f"shape of {tensor.name!r}", list(tensor.shape), f"in {file}: the"
                             f" engine's parameter has shape {list(meta.shape)}")
    if tensor.dtype == meta.dtype:
        return ""
    if tensor.dtype in CAST_FLOATS and meta.dtype in CAST_FLOATS:
        return tensor.name
    raise WeightMismatch(f"dtype of {tensor.name!r}", tensor.dtype, f"in {file}: the engine's"
                         f" parameter is {meta.dtype}, and its loader casts only between"
                         f" {', '.join(sorted(CAST_FLOATS))}")
