"""NeMo-RL's ``nccl_reshard`` refit info, read as the project's many-source sharded refit
(``core/sharded_refit.py``): the tensors it names and how the trainer ranks hold them.

NeMo-RL's info (``nemo_rl/weight_sync/nccl_reshard_utils.py``, ``build_nccl_reshard_refit_info``
and its wire-safe form) lists per layer the parameters moved in bulk, each with its global
shape, dtype and source placements over a mesh of trainer ranks, and under ``misc_meta`` the
rest (``{name: {shape, dtype}}``), which one rank sends whole. Here a bulk parameter
``Shard(0)`` over a 1-D mesh of every trainer rank is held as ``torch.chunk`` cuts it (the
sharded refit's dim-0 layout), one that is replicated over its mesh is sent whole by one rank,
like every misc parameter. Anything else is refused by name: a parameter cut along another
dimension, a mesh that also replicates (tensor x data parallel), grouped MoE experts, pipeline
stages, or a generation side other than the fleet's. The destination side needs no reading:
the engines declare their own layout before each refit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.refit import RefitInfo
from rollout_fleet.core.sharded_refit import TrainerLayout, chunk_rows

Rows = tuple[int, ...] | None  # rows per trainer rank, or None: sent whole by one rank


@attrs.frozen
class ReshardPlan:
    """The refit info and trainer layout a NeMo-RL reshard info maps to: what every trainer
    rank passes to ``ShardedTrainerSession.send_shards`` (tensors in this order)."""

    info: RefitInfo
    layout: TrainerLayout

    @property
    def state_dict_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {meta.name: (meta.shape, meta.dtype) for meta in self.info.tensors}


def reshard_plan(refit_info: Mapping[str, Any], *, inference_world_size: int,
                 tensor_parallel_size: int) -> ReshardPlan:
    """``refit_info``: NeMo-RL's, for a generation side of ``inference_world_size`` engine
    ranks with ``tensor_parallel_size`` (checked against its ``gen_*`` fields when given)."""
    if not isinstance(refit_info, Mapping):
        raise InvalidValue("refit_info", type(refit_info).__name__, "must be NeMo-RL's "
                           "nccl_reshard refit info (layer_names, per_layer_params, misc_meta)")
    trainers = _positive(refit_info, "train_world_size")
    _expect(refit_info, "pp_size", 1, "pipeline stages are not resharded here")
    _expect(refit_info, "gen_world_size", inference_world_size, "the fleet's engine ranks")
    _expect(refit_info, "gen_tp_size", tensor_parallel_size, "the fleet's tensor parallel size")
    entries: dict[str, tuple[Any, Any]] = {}
    rows: list[Rows] = []
    for param in _bulk_params(refit_info):
        name = _name(param)
        shape = param.get("global_shape")
        entries[name] = (shape, param.get("dtype"))
        rows.append(_source_rows(name, param, shape, trainers))
    for name, meta in _misc(refit_info).items():
        if name in entries:
            raise InvalidValue(f"misc_meta[{name!r}]", "a bulk parameter too", "names it twice")
        entries[name] = (meta.get("shape"), meta.get("dtype"))
        rows.append(None)
    if not entries:
        raise InvalidValue("refit_info", "no parameter", "names nothing to refit")
    info = RefitInfo.from_state_dict_info(entries)
    layout = TrainerLayout(trainers, tuple(rows))
    layout.check(info)
    return ReshardPlan(info, layout)


def _positive(refit_info: Mapping[str, Any], key: str) -> int:
    value = refit_info.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidValue(key, value, "must be an int >= 1")
    return value


def _expect(refit_info: Mapping[str, Any], key: str, wanted: int, why: str) -> None:
    value = refit_info.get(key, wanted)
    if value != wanted:
        raise InvalidValue(key, value, f"must be {wanted}: {why}")


def _bulk_params(refit_info: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    layers = refit_info.get("per_layer_params") or {}
    for layer in refit_info.get("layer_names") or list(layers):
        for param in layers.get(layer) or []:
            if not isinstance(param, Mapping):
                raise InvalidValue(f"per_layer_params[{layer!r}]", param, "must list dicts")
            yield param


def _misc(refit_info: Mapping[str, Any]) -> Mapping[str, Mapping[str, Any]]:
    misc = refit_info.get("misc_meta") or {}
    if not isinstance(misc, Mapping) or not all(isinstance(m, Mapping) for m in misc.values()):
        raise InvalidValue("misc_meta", misc, "must map name -> {shape, dtype}")
    return misc


def _name(param: Mapping[str, Any]) -> str:
    name = param.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidValue("per_layer_params[].name", name, "must be a parameter's name")
    if "grouped_expert_proj" in param:
        raise InvalidValue(f"{name}.grouped_expert_proj", param["grouped_expert_proj"],
                           "grouped MoE experts are not resharded here")
    return name


def _source_rows(name: str, param: Mapping[str, Any], shape: Any, trainers: int) -> Rows:
    mesh = _mesh_shape(param.get("src_mesh_info"), trainers)
    dims = [_shard_dim(p) for p in param.get("src_placements") or []]
    if all(dim is None for dim in dims):
        return None  # replicated over its mesh: one rank sends it whole
    if mesh != (trainers,) or dims != [0]:
        raise InvalidValue(f"{name}.src_placements", _shown(dims, mesh),
                           f"must be Shard(0) over all {trainers} trainer ranks (a 1-D mesh) or "
                           "replicated: the sharded refit takes dim-0 shards")
    if not isinstance(shape, Sequence) or not shape:
        raise InvalidValue(f"{name}.global_shape", shape, "a Shard(0) parameter has a dim 0")
    return chunk_rows(int(shape[0]), trainers)


def _mesh_shape(mesh: Any, trainers: int) -> tuple[int, ...]:
    """The shape of a source mesh (NeMo-RL's MeshInfo, or its wire form ``{"mesh": ...}``);
    its ranks must be the trainer ranks."""
    ranks = getattr(mesh, "mesh", None) if not isinstance(mesh, Mapping) else mesh.get("mesh")
    if ranks is None:
        return (trainers,)
    if hasattr(ranks, "tolist"):
        ranks = ranks.tolist()
    shape, flat = _nested(ranks)
    if sorted(flat) != list(range(trainers)):
        raise InvalidValue("src_mesh_info", ranks, f"must hold the trainer ranks 0..{trainers - 1}")
    return shape


def _nested(ranks: Any) -> tuple[tuple[int, ...], list[int]]:
    if not isinstance(ranks, list):
        return (), [int(ranks)]
    parts = [_nested(item) for item in ranks]
    inner = parts[0][0] if parts else ()
    return (len(ranks), *inner), [rank for _, flat in parts for rank in flat]


def _shard_dim(placement: Any) -> int | None:
    """Shard(d) -> d; Replicate() -> None (objects, or their wire form ``{"dim": d}`` / ``{}``)."""
    if isinstance(placement, Mapping):
        dim = placement.get("dim")
    else:
        dim = getattr(placement, "dim", None)
    return None if dim is None else int(dim)


def _shown(dims: list[int | None], mesh: tuple[int, ...]) -> str:
    shown = ", ".join("Replicate()" if d is None else f"Shard({d})" for d in dims)
    return f"[{shown}] over a mesh of shape {mesh}"
