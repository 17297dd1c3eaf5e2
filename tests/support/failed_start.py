"""A vLLM fleet made to fail at start, in a process of its own: ``python -m
tests.support.failed_start PLACEMENT`` starts one worker whose engine is given a KV cache too
small for one request of the context length (vLLM refuses it in its engine core), and prints
one JSON line: the start's error and the port claims left in the claims folder (the
environment's ``ROLLOUT_FLEET_PORT_CLAIMS``, this run's alone) while the process still lives."""

from __future__ import annotations

import json
import os
import sys

KV_CACHE_BYTES = 1 << 20  # 1 MiB: the tiny model needs more for one 512-token request
MAX_MODEL_LEN = 512


def main(placement: str) -> None:
    from rollout_fleet.adapters.shared.port_claims import CLAIMS_DIR_ENV
    from rollout_fleet.wiring.config import parse_config
    from rollout_fleet.wiring.fleet import Fleet, FleetStartError

    config = parse_config({
        "engine": {"kind": "vllm", "kv_cache_memory_bytes": KV_CACHE_BYTES},
        "num_workers": 1, "max_model_len": MAX_MODEL_LEN, "placement": placement,
        "timeouts": {"start_s": 400}})
    try:
        Fleet.start(config).shutdown()
        error = None
    except FleetStartError as exc:
        error = str(exc)
    folder = os.environ[CLAIMS_DIR_ENV]
    claims = sorted(name for name in os.listdir(folder) if name.isdigit())
    print(json.dumps({"error": error, "claims": claims}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
