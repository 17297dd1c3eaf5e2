"""The memory engine's settings: a validated value, checked when the fleet config is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from rollout_fleet.core.errors import InvalidValue
from rollout_fleet.core.validate import a_bool, finite_at_least, int_at_least, positive_int



@attrs.frozen
class MemoryEngineConfig:
    seed: int = attrs.field(default=0, validator=int_at_least("seed", 0))
    context_length: int = attrs.field(default=256, validator=int_at_least("context_length", 2))
    token_delay_s: float = attrs.field(default=0.0, validator=finite_at_least("token_delay_s"))
    max_num_seqs: int = attrs.field(default=1024, validator=positive_int("max_num_seqs"))
    kv_block_size: int = attrs.field(default=16, validator=positive_int("kv_block_size"))
    refit_ranks: int = attrs.field(default=1, validator=positive_int("refit_ranks"))
    # Bytes besides the model's that a refit may carry, received and dropped (model.py).
    refit_ballast_bytes: int = attrs.field(default=0,
                                           validator=int_at_least("refit_ballast_bytes", 0))
    # The worker also serves the engine's test controls (adapters/memory/testing_controls.py).
    test_controls: bool = attrs.field(default=False, validator=a_bool("test_controls"))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "MemoryEngineConfig":
        """From the engine options of a config; an unknown key is refused by name."""
        known = {f.name for f in attrs.fields(cls)}
        for key in data:
            if key not in known:
                raise InvalidValue(str(key), data[key],
                                   f"not an option of the memory engine; known: {', '.join(sorted(known))}")
        return cls(**data)

    def engine(self, join_receiver: Any = None):
        """The engine these settings describe (``join_receiver``: how it joins a refit group)."""
        from rollout_fleet.adapters.memory.engine import MemoryEngine

        return MemoryEngine(self.seed, context_length=self.context_length,
                            token_delay_s=self.token_delay_s, max_num_seqs=self.max_num_seqs,
                            kv_block_size=self.kv_block_size, refit_ranks=self.refit_ranks,
                            join_receiver=join_receiver,
                            refit_ballast_bytes=self.refit_ballast_bytes)
