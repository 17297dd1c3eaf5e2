"""The packed weight-transfer engine outside vLLM, over a plain torch model, for the collective
tier: the tests drive the very class vLLM's workers run without starting vLLM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout_fleet.adapters.vllm.inside.transfer_engine import PackedTransferEngine, compose_transfer_engine
from rollout_fleet.core.refit import GroupJoin
from rollout_fleet.ports.collective import WeightReceiver


def transfer_engine_over(model: Any, device: Any,
                         join_receiver: Callable[[GroupJoin, int], WeightReceiver]
                         ) -> PackedTransferEngine:
    """The engine composed as the composition root composes it (its receiver set), on no vLLM
    base class; given no vLLM config it is engine rank 0 and ``model.load_weights`` copies each
    tensor in place (``InPlaceReload``)."""
    engine_class = compose_transfer_engine(object, join_receiver, module=__name__)
    return engine_class(None, None, device, model)
