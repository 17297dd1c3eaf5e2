"""What the running vLLM offers, found by looking at it rather than at its version number.

The adapter runs on vLLM 0.25.0 (the newest whose GPU wheel pins torch 2.11 and CUDA 13) up to
0.33 (the CPU build 0.32 included). Where they differ, each feature is detected and has a
fallback:

- per-token weight versions (``CompletionOutput.weight_versions``, 0.26+): each generated token
  is labelled with the weights it was sampled under. Without it a rollout is labelled with the
  version current when it completes, which is exact only if no refit landed while it ran: the
  adapter then accepts only ``drain`` refits (nothing is in flight during the swap) and refuses
  ``keep`` and ``recompute`` by name before pausing anything.
- per-engine weight version (``AsyncLLM.update_weight_version``, 0.26+): how the adapter tells
  vLLM the version to put on those labels. Without it nothing is sent; the adapter's own count
  is the version.
- KV event sources (``AsyncLLM.get_kv_event_sources``): without it the sources are the ones the
  adapter configured (its ipc endpoint and topic).
- layerwise reload and the weight-transfer base class's abstract methods: see
  ``transfer_engine.reload_strategy`` and ``transfer_engine.compose_transfer_engine``.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class VllmFeatures:
    per_token_versions: bool
    per_engine_versions: bool
    kv_event_sources: bool
    # The refit modes whose per-token labels this vLLM can keep exact: found with the rest,
    # once, not at every refit.
    refit_modes: tuple[str, ...] = attrs.field(init=False)

    @refit_modes.default
    def _exact_refit_modes(self) -> tuple[str, ...]:
        return ("drain", "keep", "recompute") if self.per_token_versions else ("drain",)


def detect_features(engine: Any, completion_output_cls: Any = None) -> VllmFeatures:
    """The features of a started ``AsyncLLM`` (or anything shaped like one) and of vLLM's
    ``CompletionOutput`` class (imported from vLLM unless given)."""
    if completion_output_cls is None:
        from vllm.outputs import CompletionOutput

        completion_output_cls = CompletionOutput
    return VllmFeatures(
        per_token_versions=_has_field(completion_output_cls, "weight_versions"),
        per_engine_versions=callable(getattr(engine, "update_weight_version", None)),
        kv_event_sources=callable(getattr(engine, "get_kv_event_sources", None)),
    )


def _has_field(cls: Any, name: str) -> bool:
    fields = getattr(cls, "__dataclass_fields__", None)
    if fields is not None:
        return name in fields
    return hasattr(cls, name) or name in getattr(cls, "__annotations__", {})
